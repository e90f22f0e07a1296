"""`DeviceSlotTable`: the LRU slot tables kept on the GPU, admitted without a host sync.

The device twin of `SlotTable` + `LRUPolicy`: same decisions, made by the admission
kernel (`expertcache.kernels.admission`) from tables that never leave the device. Layers
of a shared pool get consecutive key ranges (``key = key_offset + local expert``). Host
reads (``expert_to_slot``, ``key_in``, ``counters``) synchronise and belong outside CUDA
graphs.
"""

from __future__ import annotations

import numpy as np
import torch

from expertcache.kernels.admission import COUNTERS, AdmissionState, admit_and_copy

#: The only eviction policy the device kernel implements.
DEVICE_POLICIES = ("lru",)


class DeviceSlotTable:
    """Device-resident key <-> slot tables, recency stamps and per-layer counters."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.device = device
        self._layer_sizes: list[int] = []
        self._started = False
        self.state = AdmissionState.empty(0, num_slots, 0, device)

    def add_layer(self, num_experts: int) -> tuple[int, int]:
        """Reserve keys for a layer of ``num_experts``; returns ``(layer_index, key_offset)``.

        Every layer must be added before the first admission (the tables then keep their
        addresses, which CUDA graphs rely on).
        """
        if self._started:
            raise RuntimeError("attach every layer to a device-mode pool before its first prepare()")
        key_offset = sum(self._layer_sizes)
        self._layer_sizes.append(num_experts)
        self.state = AdmissionState.empty(key_offset + num_experts, self.num_slots, len(self._layer_sizes), self.device)
        return len(self._layer_sizes) - 1, key_offset

    def admit(
        self,
        layer_index: int,
        key_offset: int,
        topk_ids: torch.Tensor,
        global_to_local: torch.Tensor | None,
        num_global: int,
        out: torch.Tensor,
        source: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Admit one call and copy its misses from ``source`` into ``slots`` (see `admit_and_copy`)."""
        self._started = True
        admit_and_copy(
            self.state, topk_ids, global_to_local, out, source, slots,
            num_global=num_global, key_offset=key_offset, layer=layer_index,
        )  # fmt: skip

    def expert_to_slot(self, layer_index: int, key_offset: int) -> np.ndarray:
        """``[E_local]`` int32 slot of each of the layer's experts, or -1 (synchronises)."""
        size = self._layer_sizes[layer_index]
        return self.state.expert_to_slot[key_offset : key_offset + size].cpu().numpy()

    def key_in(self, slot: int) -> int:
        """Key held by ``slot``, or -1 (synchronises)."""
        return int(self.state.slot_to_key[slot])

    def counters(self, layer_index: int) -> dict[str, int]:
        """The layer's exact counters (synchronises)."""
        row = self.state.counters[layer_index].tolist()
        return dict(zip(COUNTERS, row, strict=True))

    def layer_of_key(self, key: int) -> tuple[int, int]:
        """``(layer_index, local expert)`` of a key."""
        bounds = np.cumsum([0, *self._layer_sizes])
        layer_index = int(np.searchsorted(bounds, key, side="right") - 1)
        return layer_index, int(key - bounds[layer_index])
