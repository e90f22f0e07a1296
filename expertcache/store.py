"""`CPUBackingStore`: every (local) expert's record in host memory, pinned on CUDA machines.

Pinning goes through ``cudaHostRegister`` on an exactly sized buffer instead of torch's
caching host allocator, which rounds large requests up to a power of two (a 604 MB request
took 1027 MB in one report). The pin budget is checked before anything is allocated. The
registration is *mapped*, so GPU kernels may also read the records through their device
address (the device-driven cache does). Without CUDA the store is plain memory and every
code path still runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from expertcache.errors import PinBudgetError
from expertcache.layout import RecordLayout

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2


def _register(tensor: torch.Tensor) -> None:
    flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
    err = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, flags))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {tensor.nbytes} bytes failed (cudaError {err})")


def _unregister(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class CPUBackingStore:
    """Host copy of every expert's record.

    Args:
        layout: record layout of the registered tensors.
        weights: ``{name: [E, *shape]}`` on any device; copied in once.
        pin: register the records as pinned (page-locked, mapped) memory; needs CUDA.
        pin_budget_bytes: refuse, before allocating anything, when the records would exceed
            it (checked on CPU-only machines too, where the store is plain memory).

    Attributes:
        records: ``[E, record_bytes]`` uint8, one contiguous record per expert.
        tensors: ``{name: [E, *shape]}`` typed views into ``records``.
    """

    def __init__(
        self,
        layout: RecordLayout,
        weights: Mapping[str, torch.Tensor],
        *,
        pin: bool,
        pin_budget_bytes: int | None = None,
    ) -> None:
        num_experts = int(weights["w1"].shape[0])
        nbytes = num_experts * layout.record_bytes
        if pin_budget_bytes is not None and nbytes > pin_budget_bytes:
            raise PinBudgetError(nbytes, pin_budget_bytes)
        self.layout = layout
        self.records = torch.empty((num_experts, layout.record_bytes), dtype=torch.uint8)
        self.records.zero_()  # padding bytes are copied too: make them deterministic
        self.tensors = layout.views(self.records)
        for name, view in self.tensors.items():
            view.copy_(weights[name])
        self.pinned = False
        if pin:
            _register(self.records)
            self.pinned = True
            weakref.finalize(self, _unregister, self.records)

    @property
    def num_experts(self) -> int:
        return int(self.records.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held (and pinned, when pinned): exactly ``num_experts * record_bytes``."""
        return self.records.nbytes
