"""Slot pools: fixed-address slot buffers on the GPU, and who holds each slot.

One pool serves one layer (a per-layer budget) or many (a global pool, keys
``(layer, expert)``, where hot layers take more slots). The buffers are allocated once and
never move, so CUDA graphs and engines may keep their addresses::

    records [S, record_bytes] uint8   -- one expert record per slot (see `layout`)
    tensors {name: [S, *shape]}       -- typed views of the records, what kernels read

Two ways to decide what moves:

* `SlotPool` (host-driven): the ids are read on the host and a `SlotTable` with any
  eviction policy admits them; misses are copied by the copy engine.
* `DeviceSlotPool` (device-driven, LRU): a Triton kernel admits them on the GPU and a
  copy kernel moves the planned records from mapped pinned memory. No host sync, fixed
  shapes: a whole decode step, misses included, replays in one CUDA graph.

Free slots start filled with 0xFF bytes (NaN in every float format), a poison that a
correct remap never lets a kernel read.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from expertcache.device_table import DEVICE_POLICIES, DeviceSlotTable
from expertcache.layout import RecordLayout, layout_from_weights
from expertcache.policies import EvictionPolicy
from expertcache.slot_table import Admission, SlotTable
from expertcache.stats import CacheStats
from expertcache.store import CPUBackingStore
from expertcache.validation import resolve_device

_POISON = 0xFF


def copy_record(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy one expert record (``[record_bytes]`` uint8) host -> slot, on the current stream."""
    destination.copy_(source, non_blocking=True)


@dataclass
class _Layer:
    store: CPUBackingStore
    global_to_local: torch.Tensor | None  # [E_global] int32 on the pool's device; None = identity
    num_global: int
    index: int
    key_offset: int


class SlotPool:
    """Slot buffers on one device, assigned on the host by a `SlotTable`.

    Args:
        layout: record layout of the registered tensors (every attached layer must match).
        num_slots: number of slots ``S``.
        device: where the slots live (default: the current CUDA device, else the CPU).
        policy: eviction policy name or instance.
    """

    mode = "host"

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
        self.records = torch.full((num_slots, layout.record_bytes), _POISON, dtype=torch.uint8, device=self.device)
        self.tensors = layout.views(self.records)
        self._layers: dict[Hashable, _Layer] = {}
        self._expert_to_slot: dict[Hashable, np.ndarray] = {}
        self._version: dict[Hashable, int] = {}
        self._stats: dict[Hashable, CacheStats] = {}
        #: How a missed record reaches its slot; ``(slot_row, host_row) -> None``. Replaced
        #: only to pace copies (`expertcache.parallel.pacing`), never to change what lands.
        self.copy_record: Callable[[torch.Tensor, torch.Tensor], None] = copy_record
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
        return int(self.records.shape[0])

    @property
    def nbytes(self) -> int:
        """GPU bytes of the slot buffers."""
        return self.records.nbytes

    def attach(self, layer: Hashable, store: CPUBackingStore, global_to_local: torch.Tensor) -> None:
        """Serve ``layer``'s experts from ``store``; ``global_to_local``: ``[E_global]`` int32."""
        if layer in self._layers:
            raise ValueError(f"layer {layer!r} is already attached to this slot pool")
        self.layout.check_compatible(store.layout, what=f"layer {layer!r}")
        index, key_offset = self._add_layer(store.num_experts)
        identity = torch.equal(global_to_local.cpu(), torch.arange(store.num_experts, dtype=global_to_local.dtype))
        mapping = None if identity else global_to_local.to(self.device)
        self._layers[layer] = _Layer(store, mapping, int(global_to_local.numel()), index, key_offset)
        self._expert_to_slot[layer] = np.full(store.num_experts, -1, dtype=np.int32)
        self._version[layer] = 0
        self._stats[layer] = CacheStats()

    def _add_layer(self, num_experts: int) -> tuple[int, int]:
        return len(self._layers), 0

    def stats(self, layer: Hashable) -> CacheStats:
        """Exact counters of ``layer``."""
        return self._stats[layer]

    def expert_to_slot(self, layer: Hashable) -> np.ndarray:
        """Read-only ``[E_local]`` int32 table of ``layer``: slot of each expert, or -1."""
        table = self._expert_to_slot[layer].view()
        table.flags.writeable = False
        return table

    def expert_in(self, layer: Hashable, slot: int) -> int:
        """Local expert of ``layer`` held by ``slot``, or -1 (free, or another layer's)."""
        key = self.table.key_in(slot)
        return -1 if key is None or key[0] != layer else int(key[1])  # type: ignore[index]

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
        for key, _ in admission.evictions:
            owner, expert = cast(tuple[Hashable, int], key)
            self._expert_to_slot[owner][expert] = -1
            self._version[owner] += 1
        store = self._layers[layer].store
        for key, slot in admission.loads:
            expert = cast(tuple[Hashable, int], key)[1]
            # Pinned source, current stream: ordered before this call's kernels, and after
            # every earlier kernel that read the slot. The store never changes, so no sync.
            self.copy_record(self.records[slot], store.records[expert])
            self._expert_to_slot[layer][expert] = slot
        if admission.loads:
            self._version[layer] += 1
        self._layers_this_forward.add(layer)
        self._count(layer, admission)
        return admission

    def _count(self, layer: Hashable, admission: Admission) -> None:
        misses = len(admission.loads)
        self._stats[layer] = self._stats[layer] + CacheStats(
            hits=len(admission.hits),
            misses=misses,
            evictions=len(admission.evictions),
            bytes_h2d=misses * self.layout.record_bytes,
            calls=1,
        )


class DeviceSlotPool(SlotPool):
    """Slot buffers assigned on the GPU by the admission kernel (LRU), copies by kernel.

    Same decisions as a host `SlotPool` with ``policy="lru"``. Attach every layer before
    the first call. The read-only views synchronise with the device.
    """

    mode = "device"

    def __init__(
        self,
        layout: RecordLayout,
        num_slots: int,
        *,
        device: str | torch.device | None = None,
        policy: str | EvictionPolicy = "lru",
    ) -> None:
        if policy not in DEVICE_POLICIES:
            raise ValueError(f"device mode implements only {DEVICE_POLICIES}, got policy={policy!r}")
        super().__init__(layout, num_slots, device=device, policy=policy)
        self.device_table = DeviceSlotTable(num_slots, self.device)

    def _add_layer(self, num_experts: int) -> tuple[int, int]:
        return self.device_table.add_layer(num_experts)

    def admit(self, layer: Hashable, topk_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Admit one call on the device, copy its misses, write slot ids into ``out``."""
        entry = self._layers[layer]
        self.device_table.admit(
            entry.index, entry.key_offset, topk_ids, entry.global_to_local, entry.num_global, out,
            entry.store.records, self.records,
        )  # fmt: skip
        return out

    def stats(self, layer: Hashable) -> CacheStats:
        counters = self.device_table.counters(self._layers[layer].index)
        return CacheStats(
            hits=counters["hits"],
            misses=counters["misses"],
            evictions=counters["evictions"],
            bytes_h2d=counters["misses"] * self.layout.record_bytes,
            calls=counters["calls"],
            invalid_ids=counters["invalid_ids"],
        )

    def expert_to_slot(self, layer: Hashable) -> np.ndarray:
        entry = self._layers[layer]
        return self.device_table.expert_to_slot(entry.index, entry.key_offset)

    def expert_in(self, layer: Hashable, slot: int) -> int:
        key = self.device_table.key_in(slot)
        if key < 0:
            return -1
        index, expert = self.device_table.layer_of_key(key)
        return expert if index == self._layers[layer].index else -1

    def ensure_resident(self, layer: Hashable, experts: Sequence[int]) -> Admission:
        raise TypeError("a device-mode pool admits on the GPU: use admit()")
