"""Shared launcher helpers: where a Triton kernel can run, launching on the right GPU, and the
launch shape of the one-program walks over a call's ids (`walk_launch`)."""

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


def _scalar_loop_bounds_for_old_interpreters() -> None:
    """Let the interpreter of Triton <= 3.6 bound a loop by a loaded value under NumPy >= 2.4.

    That interpreter holds every scalar as a one-element array and makes an index of it with
    ``int(array)``, which NumPy 2.4 refuses for arrays of one dimension: our copy kernels'
    ``range(program_id, count * chunks, ...)`` then fails (later Tritons read the element).
    Only the interpreter's ``__index__`` of its tensors changes: the element itself.
    """
    import numpy as np

    try:
        int(np.zeros(1))
        return  # this NumPy still converts
    except TypeError:
        pass
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_reads_the_element", False):
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._reads_the_element = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _scalar_loop_bounds_for_old_interpreters()


def interpreted() -> bool:
    """True when Triton kernels run under the interpreter (``TRITON_INTERPRET=1`` at import)."""
    return INTERPRETED


def program_rows(tile_rows: int, size: int) -> int:
    """Output rows per program of a GEMV launch: the tile's on a GPU; under the interpreter,
    which runs programs one by one, all ``size`` rows (up to 128) in one program, the same
    code on fewer, larger blocks (each row's sum is the same, so are the results)."""
    return max(tile_rows, min(128, triton.next_power_of_2(size))) if INTERPRETED else tile_rows


def runs_on(tensor: torch.Tensor) -> bool:
    """True when the kernels can be launched on ``tensor``'s device: compiled kernels need
    CUDA tensors, interpreted ones (``TRITON_INTERPRET=1``) CPU tensors."""
    return tensor.device.type == _KERNEL_DEVICE


#: Chain the decode-path launches (admission -> copy -> expert apply) by programmatic
#: dependent launch where the GPU has it: the next kernel is launched while the previous
#: one runs and waits for it on the GPU (``griddepcontrol``), which hides a launch gap per
#: kernel inside CUDA graphs too. Benchmarks turn it off to compare.
PROGRAMMATIC_LAUNCH = True
_CHAINS: dict[int, bool] = {}


def chains_launches(device: torch.device) -> bool:
    """True when launches on ``device`` use programmatic dependent launch: compiled kernels
    on an sm_90 or later GPU, with `PROGRAMMATIC_LAUNCH` on."""
    if not PROGRAMMATIC_LAUNCH or INTERPRETED or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CHAINS:
        _CHAINS[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CHAINS[index]


def chained(device: torch.device) -> dict[str, bool]:
    """Launch options of a kernel that waits on the previous launch (``PDL`` constexpr set):
    ``kernel[grid](..., **chained(device))``."""
    if chains_launches(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for the launches inside (Triton launches on the current GPU
    and its current stream); a no-op for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


#: A one-program walk over a call's ids (admission, pass assignment) reads up to this many
#: ids a step, ``IDS_PER_THREAD`` a thread (benchmarks/bench_routing_launches.py, run 55).
WALK_BLOCK, IDS_PER_THREAD = 4096, 8


def check_num_warps(num_warps: int | None) -> None:
    """Refuse a given ``num_warps`` that is no power of two from 1 to 32 (None: the default)."""
    if num_warps is not None and not (1 <= num_warps <= 32 and num_warps & (num_warps - 1) == 0):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps}")


def walk_launch(
    num_ids: int, block_ids: int | None = None, num_warps: int | None = None, min_warps: int = 4
) -> tuple[int, int]:
    """``(BLOCK_IDS, num_warps)`` of a one-program walk over ``num_ids`` ids.

    ``block_ids`` (ids a step) defaults to the call rounded up to a power of two, between 16
    and `WALK_BLOCK`; ``num_warps`` defaults to `IDS_PER_THREAD` ids a thread, between
    ``min_warps`` and 16. Given values are taken as they are, once checked: ``block_ids`` a
    power of two from 16 to 65,536, ``num_warps`` a power of two from 1 to 32 (ValueError).
    """
    if block_ids is not None and not (16 <= block_ids <= 2**16 and block_ids & (block_ids - 1) == 0):
        raise ValueError(f"block_ids must be a power of two from 16 to 65536, got {block_ids}")
    check_num_warps(num_warps)
    block = block_ids or min(WALK_BLOCK, max(16, triton.next_power_of_2(num_ids)))
    return block, num_warps or max(min_warps, min(16, block // (32 * IDS_PER_THREAD)))
