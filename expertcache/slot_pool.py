"""`SlotPool`: fixed-address slot buffers on the GPU, and the table of who holds them.

One pool serves one layer (a per-layer budget) or many (a global pool, keys
``(layer, expert)``, where hot layers take more slots). The buffers are allocated once and
never move, so CUDA graphs and engines may keep their addresses::

    records [S, record_bytes] uint8   -- one expert record per slot (see `layout`)
    tensors {name: [S, *shape]}       -- typed views of the records, what kernels read

Free slots start filled with 0xFF bytes (NaN in every float format), a poison that a
correct remap never lets a kernel read.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch

from expertcache.layout import RecordLayout, layout_from_weights
from expertcache.policies import EvictionPolicy
from expertcache.slot_table import Admission, SlotTable
from expertcache.store import CPUBackingStore
from expertcache.validation import resolve_device

_POISON = 0xFF


class SlotPool:
    """Slot buffers on one device plus the `SlotTable` that assigns them.

    Args:
        layout: record layout of the registered tensors (every attached layer must match).
        num_slots: number of slots ``S``.
        device: where the slots live (default: the current CUDA device, else the CPU).
        policy: eviction policy name or instance.
    """

    def __init__(
        self,
        layout: RecordLayout,
        num_slots: int,
        *,
        device: str | torch.device | None = None,
        policy: str | EvictionPolicy = "lru",
    ) -> None:
        self.layout = layout
        self.device = resolve_device(device)
        self.table = SlotTable(num_slots, policy=policy)
        self.records = torch.full(
            (num_slots, layout.record_bytes), _POISON, dtype=torch.uint8, device=self.device
        )
        self.tensors = layout.views(self.records)
        self._stores: dict[Hashable, CPUBackingStore] = {}
        self._expert_to_slot: dict[Hashable, np.ndarray] = {}
        self._version: dict[Hashable, int] = {}
        self._layers_this_forward: set[Hashable] = set()

    @classmethod
    def for_weights(
        cls,
        weights: Mapping[str, torch.Tensor],
        num_slots: int,
        *,
        device: str | torch.device | None = None,
        policy: str | EvictionPolicy = "lru",
    ) -> SlotPool:
        """A pool whose slots fit experts shaped like ``weights`` (``{name: [E, ...]}``)."""
        _, layout = layout_from_weights(weights)
        return cls(layout, num_slots, device=device, policy=policy)

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    @property
    def nbytes(self) -> int:
        """GPU bytes of the slot buffers."""
        return self.records.nbytes

    def attach(self, layer: Hashable, store: CPUBackingStore) -> None:
        """Serve ``layer``'s experts from ``store`` through this pool."""
        if layer in self._stores:
            raise ValueError(f"layer {layer!r} is already attached to this slot pool")
        self.layout.check_compatible(store.layout, what=f"layer {layer!r}")
        self._stores[layer] = store
        self._expert_to_slot[layer] = np.full(store.num_experts, -1, dtype=np.int32)
        self._version[layer] = 0

    def layers(self) -> tuple[Hashable, ...]:
        """The attached layers, in attach order."""
        return tuple(self._stores)

    def expert_to_slot(self, layer: Hashable) -> np.ndarray:
        """Read-only ``[E_local]`` int32 table of ``layer``: slot of each expert, or -1."""
        table = self._expert_to_slot[layer].view()
        table.flags.writeable = False
        return table

    def version(self, layer: Hashable) -> int:
        """Counter that changes whenever ``layer``'s expert -> slot table changes."""
        return self._version[layer]

    def ensure_resident(self, layer: Hashable, experts: Sequence[int]) -> Admission:
        """Admit one call's experts of ``layer`` and copy the misses into their slots.

        Args:
            layer: an attached layer.
            experts: distinct local expert ids in first-appearance order.

        Raises:
            CacheCapacityError: more experts than slots; nothing changes.
        """
        self.table.check_capacity(len(experts))
        if layer in self._layers_this_forward:  # a layer came round again: a new forward pass
            self._layers_this_forward.clear()
        if not self._layers_this_forward:
            self.table.begin_forward()
        admission = self.table.admit([(layer, expert) for expert in experts])
        for (owner, expert), _ in admission.evictions:
            self._expert_to_slot[owner][expert] = -1
            self._version[owner] += 1
        store = self._stores[layer]
        for (_, expert), slot in admission.loads:
            # Pinned source, current stream: ordered before this call's kernels, and after
            # every earlier kernel that read the slot. The store never changes, so no sync.
            self.records[slot].copy_(store.records[expert], non_blocking=True)
            self._expert_to_slot[layer][expert] = slot
        if admission.loads:
            self._version[layer] += 1
        self._layers_this_forward.add(layer)
        return admission
