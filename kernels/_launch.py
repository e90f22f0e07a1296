"""Shared launcher helpers: where a Triton kernel can run, and launching on the right GPU."""

from __future__ import annotations

import contextlib

import torch
import triton

try:  # the interpreter runs kernels on CPU tensors when TRITON_INTERPRET=1 at import time
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - very old Triton
    InterpretedFunction = ()  # type: ignore[assignment,misc]


@triton.jit
def _probe():
    pass


#: Whether Triton kernels run under the interpreter (``TRITON_INTERPRET=1`` when they were
#: defined); decided once, so ``torch.compile`` traces the checks below as constants.
INTERPRETED = isinstance(_probe, InterpretedFunction)
_KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"


def interpreted() -> bool:
    """True when Triton kernels run under the interpreter (``TRITON_INTERPRET=1`` at import)."""
    return INTERPRETED


def runs_on(tensor: torch.Tensor) -> bool:
    """True when the kernels can be launched on ``tensor``'s device: compiled kernels need
    CUDA tensors, interpreted ones (``TRITON_INTERPRET=1``) CPU tensors."""
    return tensor.device.type == _KERNEL_DEVICE


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for the launches inside (Triton launches on the current GPU
    and its current stream); a no-op for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
