"""`CachedWeightProvider`: a layer's experts in pinned host memory, the hot ones in GPU slots.

Host-driven admission (``mode="host"``, any eviction policy), one call::

    topk_ids [T, K] on the GPU
      -> read on the host (one device-to-host sync), range-checked, mapped global -> local,
         deduplicated in first-appearance order
      -> SlotPool.ensure_resident: hits, misses, victims (never one this call needs);
         misses copied host -> slot
      -> the layer's [E_global] int32 id -> slot table refreshed if it changed
      -> remap kernel: topk_ids -> slot ids (-1 for other ranks' experts)

Device-driven admission (``mode="device"``, LRU): the same decisions made by a Triton kernel
on the GPU, misses copied by a kernel reading mapped pinned memory; no host sync, so the
call can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np
import torch

from expertcache.errors import CacheCapacityError
from expertcache.kernels import remap_topk_ids
from expertcache.layout import layout_from_weights
from expertcache.policies import EvictionPolicy
from expertcache.provider import ExpertWeightProvider, result_from_tensors
from expertcache.result import ExpertWeightResult
from expertcache.slot_pool import DeviceSlotPool, SlotPool
from expertcache.stats import CacheStats
from expertcache.store import CPUBackingStore
from expertcache.validation import check_expert_map, check_topk_ids, resolve_device

MODES = {"host": SlotPool, "device": DeviceSlotPool}


class CachedWeightProvider(ExpertWeightProvider):
    """Serves one MoE layer's experts through a fixed pool of GPU slots.

    Args:
        weights: ``{name: [E, *shape]}`` host (or any-device) tensors whose first dimension
            is the expert: ``"w1"`` ``[E, 2I, H]`` (gate rows, then up rows), ``"w2"``
            ``[E, H, I]``, optional ``"w1_scale"``, ``"w2_scale"``, and any other name
            (biases, MXFP4 scales, ...), which comes back in ``ExpertWeightResult.extra``.
            They are copied into the backing store; the caller may free them afterwards.
            A `CPUBackingStore` may be passed instead, to share one store between providers.
        cache_size: number of GPU slots, ``1 <= cache_size <= E``. Omit when ``pool`` is given.
        device: the GPU (default: the current CUDA device, else the CPU).
        policy: eviction policy name (``"lru"``) or instance.
        expert_map: optional ``[E_global]`` int32, global id -> local index or -1 (expert
            parallelism); ``weights`` then hold only the local experts, and other ranks'
            ids come out as -1 and are never loaded.
        pin_budget_bytes: refuse, before pinning anything, when the store would exceed it.
        pool: a `SlotPool` shared with other layers (a global budget) instead of a private
            pool of ``cache_size`` slots.
        layer: this layer's key in a shared pool (any hashable, unique per pool).
        mode: ``"host"`` (default) or ``"device"`` (GPU admission, CUDA-graph capturable,
            LRU only). With ``pool``, it defaults to (and must equal) the pool's mode.
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor] | CPUBackingStore,
        *,
        cache_size: int | None = None,
        device: str | torch.device | None = None,
        policy: str | EvictionPolicy = "lru",
        expert_map: torch.Tensor | None = None,
        pin_budget_bytes: int | None = None,
        pool: SlotPool | None = None,
        layer: Hashable = 0,
        mode: str | None = None,
    ) -> None:
        if isinstance(weights, CPUBackingStore):
            num_local, layout = weights.num_experts, weights.layout
        else:
            num_local, layout = layout_from_weights(weights)
        if mode is None:
            mode = "host" if pool is None else pool.mode
        if mode not in MODES or (pool is not None and pool.mode != mode):
            raise ValueError(f"mode must be one of {sorted(MODES)} (and the pool's), got {mode!r}")
        if pool is None:
            _check_cache_size(cache_size, num_local)
            target = resolve_device(device)
        else:
            if cache_size is not None:
                raise ValueError("give either cache_size (a private pool) or pool, not both")
            target = pool.device
            if device is not None and resolve_device(device) != target:
                raise ValueError(f"device {device} differs from the shared pool's {target}")
            pool.layout.check_compatible(layout, what="weights")
        if expert_map is None:
            global_to_local = torch.arange(num_local, dtype=torch.int32)
        else:
            global_to_local = check_expert_map(expert_map, num_local)
        if isinstance(weights, CPUBackingStore):
            store = weights
        else:
            pin = target.type == "cuda"
            store = CPUBackingStore(layout, weights, pin=pin, pin_budget_bytes=pin_budget_bytes)
        if pool is None:
            pool = MODES[mode](layout, int(cache_size), device=target, policy=policy)  # type: ignore[arg-type]
        pool.attach(layer, store, global_to_local)
        self.pool = pool
        self.layer = layer
        self.store = store
        self.num_experts = num_local
        self.num_global_experts = int(global_to_local.numel())
        self._global_to_local = global_to_local.numpy().astype(np.int64)
        self._is_local = self._global_to_local >= 0
        self._mapping = torch.full((self.num_global_experts,), -1, dtype=torch.int32, device=target)
        self._mapping_version = -1

    # -- read-only views (device mode: these synchronise; call them outside graphs) ---------

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def mode(self) -> str:
        return self.pool.mode

    @property
    def stats(self) -> CacheStats:
        """Exact counters of this layer (an immutable snapshot)."""
        return self.pool.stats(self.layer)

    def resident(self) -> frozenset[int]:
        """Local expert ids that hold a slot now."""
        return frozenset(np.flatnonzero(self.pool.expert_to_slot(self.layer) >= 0).tolist())

    def slot_of(self, expert_id: int) -> int:
        """Slot holding local expert ``expert_id``, or -1."""
        if not 0 <= int(expert_id) < self.num_experts:
            raise IndexError(f"expert {expert_id} is outside [0, {self.num_experts})")
        return int(self.pool.expert_to_slot(self.layer)[int(expert_id)])

    def expert_in(self, slot: int) -> int:
        """Local expert held by ``slot`` for this layer, or -1 (free, or another layer's)."""
        if not 0 <= int(slot) < self.pool.num_slots:
            raise IndexError(f"slot {slot} is outside [0, {self.pool.num_slots})")
        return self.pool.expert_in(self.layer, int(slot))

    # -- the call --------------------------------------------------------------------------

    def prepare(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        """Load every local expert of ``topk_ids`` into a slot and remap the ids to slots.

        Args:
            topk_ids: ``[T, K]`` int32/int64 global expert ids on the cache's device.

        Returns:
            `ExpertWeightResult` whose ``w1`` ``[S, 2I, H]``, ``w2`` ``[S, H, I]`` (and
            scales, extras) are the slot buffers and whose ``topk_ids`` (dtype of the input)
            hold slot ids, -1 for experts of other ranks.

        Raises:
            TypeError / ValueError / IndexError: bad ids (dtype, shape, device, range).
            CacheCapacityError: more distinct local experts than slots.
            In every case the cache is left exactly as it was. Device mode checks ids on
            the host only when ``T * K > num_slots`` (prefill); smaller calls never sync,
            and ids outside ``[0, E)`` come out -1, counted in ``stats.invalid_ids``.
        """
        check_topk_ids(topk_ids, self.device)
        if self.pool.mode == "device":
            return self._prepare_on_device(topk_ids)
        experts = self._local_experts_in_use(topk_ids)
        self.pool.ensure_resident(self.layer, experts)
        self._refresh_mapping()
        slot_ids = remap_topk_ids(topk_ids, self._mapping)
        return result_from_tensors(self.pool.tensors, slot_ids)

    def _prepare_on_device(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        if topk_ids.numel() > self.pool.num_slots:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError(
                    f"a CUDA graph can hold a call of at most num_slots={self.pool.num_slots} "
                    f"ids (got {topk_ids.numel()}): only then can it never overflow the cache"
                )
            experts = self._local_experts_in_use(topk_ids)  # prefill: a sync is cheap here
            if len(experts) > self.pool.num_slots:
                raise CacheCapacityError(len(experts), self.pool.num_slots)
        out = torch.empty_like(topk_ids, memory_format=torch.contiguous_format)
        self.pool.admit(self.layer, topk_ids.contiguous(), out)  # type: ignore[attr-defined]
        return result_from_tensors(self.pool.tensors, out)

    def _local_experts_in_use(self, topk_ids: torch.Tensor) -> list[int]:
        flat = topk_ids.reshape(-1).cpu().numpy()  # the host-driven path's one sync
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_global_experts):
            bad = flat[(flat < 0) | (flat >= self.num_global_experts)][0]
            raise IndexError(f"expert id {bad} in topk_ids is outside [0, {self.num_global_experts})")
        local = self._global_to_local[flat]
        local = local[local >= 0]
        _, first = np.unique(local, return_index=True)
        return local[np.sort(first)].tolist()

    def _refresh_mapping(self) -> None:
        version = self.pool.version(self.layer)
        if version == self._mapping_version:
            return
        slots = self.pool.expert_to_slot(self.layer)[self._global_to_local.clip(min=0)]
        host = torch.from_numpy(np.where(self._is_local, slots, -1).astype(np.int32))
        if self.device.type == "cuda":
            # A pinned staging copy lets the upload run asynchronously; torch's host
            # allocator keeps the block alive until the copy has finished.
            host = host.pin_memory()
        self._mapping.copy_(host, non_blocking=True)
        self._mapping_version = version


def _check_cache_size(cache_size: object, num_experts: int) -> None:
    if cache_size is None:
        raise ValueError("cache_size (the number of GPU slots) is required")
    if not isinstance(cache_size, int) or isinstance(cache_size, bool):
        raise TypeError(f"cache_size must be an int, got {type(cache_size).__name__}")
    if not 1 <= cache_size <= num_experts:
        raise ValueError(
            f"cache_size must be between 1 and the number of local experts ({num_experts}), got {cache_size}"
        )
