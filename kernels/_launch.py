"""Shared launcher helpers: where a Triton kernel can run."""

from __future__ import annotations

import torch

try:  # the interpreter runs kernels on CPU tensors when TRITON_INTERPRET=1 at import time
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - very old Triton
    InterpretedFunction = ()  # type: ignore[assignment,misc]


def runs_on(kernel: object, tensor: torch.Tensor) -> bool:
    """True when ``kernel`` can be launched on ``tensor``'s device.

    Compiled kernels need CUDA tensors; interpreted ones (``TRITON_INTERPRET=1``) need CPU
    tensors.
    """
    interpreted = isinstance(kernel, InterpretedFunction)
    return tensor.device.type == ("cpu" if interpreted else "cuda")
