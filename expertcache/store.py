"""`CPUBackingStore`: every (local) expert of a layer in host memory, pinned on CUDA machines.

One host buffer holds one contiguous ``[E, *shape]`` region per registered tensor (see
`expertcache.layout`). Pinning goes through ``cudaHostRegister`` on that exactly sized
buffer instead of torch's caching host allocator, which rounds large requests up to a
power of two (a 604 MB request took 1027 MB in one report). The pin budget is checked
before anything is allocated. The registration is *mapped*, so GPU kernels may read the
experts through their device address (the copy kernel does). Without CUDA the store is
plain memory and every code path still runs.

Lifetime: the buffer is unregistered and freed only after every CUDA device has finished
the work queued so far, so a copy still reading the store never reads freed memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from expertcache.errors import PinBudgetError
from expertcache.layout import ExpertLayout

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2

#: Buffers whose release came during a CUDA graph capture (no sync is allowed then).
_DEFERRED: list[torch.Tensor] = []


def _register(buffer: torch.Tensor) -> None:
    flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, flags))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {buffer.nbytes} bytes failed (cudaError {err})")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _release(buffer: torch.Tensor) -> None:
    """Unregister ``buffer`` once no queued GPU work can still read it."""
    _DEFERRED.append(buffer)
    _flush_released()


def _flush_released() -> None:
    if not _DEFERRED or _capturing():
        return  # synchronising would break a capture: the next release or new store does it
    for device in range(torch.cuda.device_count()):
        torch.cuda.synchronize(device)
    while _DEFERRED:
        torch.cuda.cudart().cudaHostUnregister(_DEFERRED.pop().data_ptr())


class CPUBackingStore:
    """Host copy of every expert of one layer.

    Args:
        layout: the registered tensors.
        weights: ``{name: [E, *shape]}`` on any device; copied in once.
        pin: register the buffer as pinned (page-locked, mapped) memory; needs CUDA.
        pin_budget_bytes: refuse, before allocating anything, when the buffer would exceed
            it (checked on CPU-only machines too, where the store is plain memory).

    Attributes:
        buffer: ``[buffer_bytes]`` uint8, the one allocation (pinned when ``pinned``).
        tensors: ``{name: [E, *shape]}`` contiguous typed views into ``buffer``.
    """

    def __init__(
        self,
        layout: ExpertLayout,
        weights: Mapping[str, torch.Tensor],
        *,
        pin: bool,
        pin_budget_bytes: int | None = None,
    ) -> None:
        num_experts = int(weights["w1"].shape[0])
        nbytes = layout.buffer_bytes(num_experts)
        budget_type = type(pin_budget_bytes)
        if pin_budget_bytes is not None and (budget_type is bool or not isinstance(pin_budget_bytes, int)):
            raise TypeError(f"pin_budget_bytes must be an int (bytes) or None, got {budget_type.__name__}")
        if pin_budget_bytes is not None and nbytes > pin_budget_bytes:
            raise PinBudgetError(nbytes, pin_budget_bytes)
        if pin and not torch.cuda.is_available():
            raise ValueError("pin=True needs CUDA; on a CPU-only machine the store is plain memory")
        self.layout = layout
        self.num_experts = num_experts
        # outside inference mode (usable inside and outside it) and outside autograd (the
        # caller's tensors, parameters included, are copied, never referenced)
        with torch.inference_mode(False), torch.no_grad():
            self.buffer = torch.zeros(nbytes, dtype=torch.uint8)  # padding bytes deterministic
            self.tensors = layout.views(self.buffer, num_experts)
            for name, view in self.tensors.items():
                view.copy_(weights[name].detach())
        self.pinned = False
        if pin:
            _flush_released()
            _register(self.buffer)
            self.pinned = True
            weakref.finalize(self, _release, self.buffer)

    @property
    def nbytes(self) -> int:
        """Bytes held (and pinned, when pinned): the regions and their alignment padding."""
        return self.buffer.nbytes
