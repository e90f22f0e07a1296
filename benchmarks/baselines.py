"""Providers that exist only to be compared against: the peer and the streaming baseline.

* `FlashlibLRUProvider`: flashlib 0.4.0's ``lru_ensure`` (device-side LRU admission, the
  best published peer mechanism) driving slot tensors like ours and our copy kernel.
* `WholeLayerStreamingProvider`: what a prefetch offloader does: every expert of the layer
  copied to the GPU each call (copy engine, pinned), then used in place.
"""

from __future__ import annotations

import torch

from expertcache.kernels.copy_experts import CopyPlan, copy_experts
from expertcache.mover import copy_groups
from expertcache.provider import ExpertWeightProvider, result_from_tensors
from expertcache.result import ExpertWeightResult
from expertcache.stats import CacheStats
from expertcache.store import CPUBackingStore


class FlashlibLRUProvider(ExpertWeightProvider):
    """flashlib ``lru_ensure`` admission + the expertcache copy kernel, one layer."""

    def __init__(self, store: CPUBackingStore, num_slots: int, max_ids: int) -> None:
        from flashlib.kernels.slot_cache import N_STATS, lru_ensure

        self._lru_ensure = lru_ensure
        self.store = store
        self.tensors = store.layout.allocate(num_slots, torch.device("cuda"), 0xFF)
        (self._group,) = copy_groups(store)

        def full(size, value, dtype):
            return torch.full(size, value, dtype=dtype, device="cuda")

        self.slot_of_id = full((store.num_experts,), -1, torch.int32)
        self.id_of_slot = full((num_slots,), -1, torch.int32)
        self.lru_usage = full((num_slots,), 0, torch.int64)
        self.lru_step = full((), 0, torch.int64)
        plan = min(max_ids, num_slots)
        self.src = full((plan,), 0, torch.int32)
        self.dst = full((plan,), 0, torch.int32)
        self.num_copy = full((), 0, torch.int64)
        self.counters = full((N_STATS,), 0, torch.int64)

    def prepare(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        query = topk_ids.reshape(-1).to(torch.int32)
        out = torch.empty_like(query)
        self._lru_ensure(
            query, self.slot_of_id, self.id_of_slot, self.lru_usage, self.lru_step,
            out, self.src, self.dst, self.num_copy, self.counters,
        )  # fmt: skip
        copy_experts(
            self.store.buffer, list(self.tensors.values()), CopyPlan(self.num_copy.view(1), self.src, self.dst, 1),
            self._group.segments, unit=self.store.layout.copy_unit, num_experts=self.store.num_experts,
        )  # fmt: skip
        return result_from_tensors(self.tensors, out.view(topk_ids.shape))

    @property
    def stats(self) -> CacheStats:
        active, misses, calls = self.counters.tolist()
        return CacheStats(
            hits=active - misses,
            misses=misses,
            bytes_h2d=misses * self.store.layout.expert_bytes,
            calls=calls,
        )


class WholeLayerStreamingProvider(ExpertWeightProvider):
    """Copies all of a layer's experts into a shared staging buffer on every call."""

    def __init__(self, store: CPUBackingStore, staging: torch.Tensor) -> None:
        self.store = store
        self.staging = staging  # [store.nbytes] uint8 on the GPU, shared by all layers
        self.tensors = store.layout.views(staging, store.num_experts)
        self.calls = 0

    def prepare(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        self.staging.copy_(self.store.buffer, non_blocking=True)
        self.calls += 1
        return result_from_tensors(self.tensors, topk_ids)

    @property
    def stats(self) -> CacheStats:
        return CacheStats(
            misses=self.calls * self.store.num_experts,
            bytes_h2d=self.calls * self.store.nbytes,
            calls=self.calls,
        )
