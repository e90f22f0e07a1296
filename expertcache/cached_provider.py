"""`CachedWeightProvider`: a layer's experts in pinned host memory, the hot ones in GPU slots.

A thin face on the machinery: it builds the layer's `CPUBackingStore`, attaches it to a
`SlotPool` (its own, or one shared by many layers), and turns each ``prepare`` into an
`ExpertWeightResult` over the pool's slot tensors::

    topk_ids [T, K] -> SlotPool.prepare: plan (host policy | device LRU), move, commit + remap
                    -> ExpertWeightResult(w1 [S, 2I, H], w2 [S, H, I], ..., topk_ids = slot ids)

and each ``passes`` into one such result per expert-group pass (`expertcache.passes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Hashable, Iterator, Mapping

import numpy as np
import torch

from expertcache.layout import layout_from_weights
from expertcache.manifest import Manifest, build_manifest
from expertcache.policies import EvictionPolicy
from expertcache.provider import ExpertWeightProvider, PassResults, result_from_tensors
from expertcache.result import ExpertWeightResult, Landing
from expertcache.slot_pool import SlotPool
from expertcache.stats import CacheStats
from expertcache.store import CPUBackingStore, check_compression
from expertcache.validation import check_expert_map, check_int, check_pin_budget_bytes, resolve_device


class CachedWeightProvider(ExpertWeightProvider):
    """Serves one MoE layer's experts through a fixed pool of GPU slots.

    Args:
        weights: ``{name: [E, *shape]}`` host (or any-device) tensors whose first dimension
            is the expert: ``"w1"`` ``[E, 2I, H]`` (gate rows, then up rows), ``"w2"``
            ``[E, H, I]``, optional ``"w1_scale"``, ``"w2_scale"``, and any other name
            (biases, MXFP4 scales, ...), which comes back in ``ExpertWeightResult.extra``.
            They are copied into the backing store; the caller may free them afterwards.
            A `CPUBackingStore` may be passed instead, to share one store between providers.
        cache_size: number of GPU slots, an integer (numpy's too) ``1 <= cache_size <= E``.
            Omit when ``pool`` is given.
        device: the GPU (default: the current CUDA device, else the CPU).
        policy: eviction policy name (``"lru"``, the default) or a fresh instance (host mode).
        expert_map: optional ``[E_global]`` int32, global id -> local index or -1 (expert
            parallelism); ``weights`` then hold only the local experts, and other ranks'
            ids come out as -1 and are never loaded.
        pin_budget_bytes: None (no limit) or bytes ``>= 0``: refuse, before pinning anything,
            when the store would exceed it.
        pool: a `SlotPool` shared with other layers (a global budget) instead of a private
            pool of ``cache_size`` slots; ``device``, ``policy`` and ``mode`` are the pool's
            then (giving them raises). Each layer keeps its share, ``num_slots // layers``,
            and one call holds at most a share of experts (`expertcache.layer_shares`).
        layer: this layer's name in a shared pool (any hashable, unique per pool).
        mode: ``"host"`` (default: any policy, one host sync per call) or ``"device"``
            (GPU admission, LRU only, no sync: CUDA-graph capturable).
        compression: ``None`` (default: raw bytes) or ``"exponent"``: bf16/fp16 experts
            stored losslessly coded (`expertcache.compression`, ~0.68 of the bytes for
            bf16), decoded by the copy kernel on the way into the slots, which receive the
            exact weights. PCIe carries the coded bytes (``stats.compressed_bytes_h2d``).
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor] | CPUBackingStore,
        *,
        cache_size: int | None = None,
        device: str | torch.device | None = None,
        policy: str | EvictionPolicy | None = None,
        expert_map: torch.Tensor | None = None,
        pin_budget_bytes: int | None = None,
        pool: SlotPool | None = None,
        layer: Hashable = 0,
        mode: str | None = None,
        compression: str | None = None,
    ) -> None:
        if isinstance(weights, CPUBackingStore):
            if pin_budget_bytes is not None or compression is not None:
                given = "pin_budget_bytes" if pin_budget_bytes is not None else "compression"
                raise ValueError(f"{given} applies when the store is built; this one is built already")
            num_local, layout = weights.num_experts, weights.layout
        else:
            num_local, layout = layout_from_weights(weights)
            check_compression(compression, layout)
            check_pin_budget_bytes(pin_budget_bytes)  # before a pool is built
        if pool is not None:
            _check_shared_pool(pool, cache_size=cache_size, device=device, policy=policy, mode=mode)
            pool.layout.check_compatible(layout, what="weights")
            target = pool.device
        else:
            _check_cache_size(cache_size, num_local)
            target = resolve_device(device)
        global_to_local = (
            torch.arange(num_local, dtype=torch.int32)
            if expert_map is None
            else check_expert_map(expert_map, num_local)
        )
        if pool is None:
            pool = SlotPool(
                layout, int(cache_size),  # type: ignore[arg-type]
                device=target, policy="lru" if policy is None else policy, mode="host" if mode is None else mode,
            )  # fmt: skip
        if isinstance(weights, CPUBackingStore):
            store = weights
        else:
            store = CPUBackingStore(
                layout, weights, pin=target.type == "cuda", pin_budget_bytes=pin_budget_bytes, compression=compression
            )
        self.pool = pool
        self.store = store
        self.layer = pool.attach(layer, store, global_to_local)
        self.num_experts = num_local
        self.num_global_experts = int(global_to_local.numel())

    # -- read-only views (they read the device tables: call them outside CUDA graphs) -------

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

    @property
    def prefetch_stats(self) -> CacheStats:
        """Exact counters of this layer's prefetches (``hits``: already resident, ``misses``:
        copied); kept apart from `stats`."""
        return self.pool.prefetch_stats(self.layer)

    def resident(self) -> frozenset[int]:
        """Local expert ids that hold a slot now."""
        return frozenset(np.flatnonzero(self.pool.expert_to_slot(self.layer) >= 0).tolist())

    def slot_of(self, expert_id: int) -> int:
        """Slot holding local expert ``expert_id`` (an int, numpy's too), or -1."""
        expert = check_int("expert_id", expert_id)
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} is outside [0, {self.num_experts})")
        return int(self.pool.expert_to_slot(self.layer)[expert])

    def expert_in(self, slot: int) -> int:
        """Local expert held by ``slot`` (an int, numpy's too) for this layer, or -1 (free, or
        another layer's)."""
        number = check_int("slot", slot)
        if not 0 <= number < self.pool.num_slots:
            raise IndexError(f"slot {number} is outside [0, {self.pool.num_slots})")
        return self.pool.expert_in(self.layer, number)

    def manifest(self) -> Manifest:
        """Registered tensors, slots and bytes of this layer (see `expertcache.manifest`)."""
        return build_manifest([self])

    # -- the call --------------------------------------------------------------------------

    def prepare(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        """Load every local expert of ``topk_ids`` into a slot and remap the ids to slots.

        Args:
            topk_ids: ``[T, K]`` int32/int64 global expert ids on the cache's device.

        Returns:
            `ExpertWeightResult` whose ``w1`` ``[S, 2I, H]``, ``w2`` ``[S, H, I]`` (and
            scales, extras) are the pool's contiguous slot tensors and whose ``topk_ids``
            (dtype of the input) hold slot ids, -1 for experts of other ranks. **Valid until
            the next ``prepare`` on the same pool** (any layer of a shared pool): that call
            may overwrite these slots.

        Raises:
            TypeError / ValueError / IndexError: bad ids (dtype, shape, device, range).
            CacheCapacityError: more distinct local experts than slots (than the share, in
                a shared pool).
            ConcurrentUseError: another thread is inside this provider's pool.
            In every case the cache is left exactly as it was. Device mode checks ids on
            the host only when ``min(T * K, E_local)`` exceeds the slots (the share; prefill); smaller calls never sync,
            and ids outside ``[0, E)`` come out -1, counted in ``stats.invalid_ids``.
        """
        return result_from_tensors(self.pool.tensors, self.pool.prepare(self.layer, topk_ids))

    def prefetch(self, expert_ids: torch.Tensor) -> None:
        """Start copying experts a predictor expects the next call to need; returns at once.

        Args:
            expert_ids: ``[N]`` or ``[T, K]`` int32/int64 global ids on the cache's device, at
                most ``cache_size`` of them, e.g. the top-k of this layer's router applied to
                an earlier layer's hidden state.

        Device mode with a pool of its own only. The copies run on the pool's copy stream and
        overlap what the current stream does next (other layers' compute); this layer's next
        ``prepare`` or ``passes`` waits for them, and finds the right guesses resident. Wrong
        guesses cost their copies and may evict useful experts. Capturable in a CUDA graph
        (the next call must be captured too). See `SlotPool.prefetch`.
        """
        self.pool.prefetch(self.layer, expert_ids)

    def finish_prefetch(self) -> None:
        """Make the current stream wait for this layer's prefetch copies still running.

        ``prepare`` and ``passes`` do it by themselves; call it only before a CUDA graph's
        capture ends when the layer's next call is outside that graph (a prefetch for the
        next step: `DecodeStack`'s ``across_steps``). See `SlotPool.finish_prefetch`.
        """
        self.pool.finish_prefetch(self.layer)

    def check_prefetch(self, expert_ids: torch.Tensor) -> None:
        """Raise as `prefetch` would for ``expert_ids``, changing nothing (`SlotPool.check_prefetch`)."""
        self.pool.check_prefetch(self.layer, expert_ids)

    def passes(
        self, topk_ids: torch.Tensor, *, overlap: bool = False, landing: bool = False
    ) -> Iterator[ExpertWeightResult]:
        """Serve a call of any size, in expert-group passes when its experts exceed the slots.

        Args:
            topk_ids: ``[T, K]`` int32/int64 global expert ids on the cache's device.
            overlap: the caller sums passes exactly (`expertcache.kernels.moe_apply_passes`
                does): a call that does not fit then runs in overlapped passes (groups of
                half the slots; in device mode each pass's copies run on a side stream
                while the pass before computes), and device mode serves the first pass (the
                whole call, when it fits) as its hits (computed while the misses are copied
                on a side stream) and then its misses (`SlotPool.passes`).
            landing: the caller's kernel waits on ``result.landing`` counters before it
                reads a slot (`expertcache.kernels.landing`; `moe_apply_passes` does): an
                overlapped device-mode call captured in a CUDA graph then hands over its
                copied passes once they are admitted, and the kernel starts on each expert as
                it lands. Elsewhere (`SlotPool.passes`) the results carry no counters.

        Returns:
            An iterator of `ExpertWeightResult` (slot tensors as from ``prepare``), one per
            pass; each result's ``topk_ids`` hold its pass's slot ids and -1 for the ids of
            every other pass, so a kernel that skips -1 computes the pass's share and the
            sum over passes is the layer's output. Resident experts are used in pass 0
            before anything is copied; every expert is loaded at most once per call. Run
            the kernel on each result before taking the next: the next pass may overwrite
            its slots. Leave ``topk_ids`` unchanged until the last pass is taken: each pass
            reads them. Device mode yields `expertcache.passes.max_passes` results whatever
            the routing (no sync: a CUDA graph captures them), the unneeded ones all -1, and
            one more when the first pass is split (hits, then misses). Closing the
            iterator early ends the call at once (`SlotPool.passes`).

        Raises:
            As ``prepare`` (never `CacheCapacityError`); bad ids raise before anything runs.
        """
        passes = self.pool.passes(self.layer, topk_ids, overlap=overlap, landing=landing)
        results = _results(self.pool.tensors, passes)
        return PassResults(self.pool.tensors, results, topk_ids=topk_ids, landing=landing)


def _results(
    tensors: Mapping[str, torch.Tensor], passes: Generator[tuple[torch.Tensor, Landing | None]]
) -> Generator[ExpertWeightResult]:
    with contextlib.closing(passes):  # a caller's close() reaches the pool's passes at once
        for ids, landing in passes:
            yield result_from_tensors(tensors, ids, landing)


def _check_shared_pool(pool: object, **settings: object) -> None:
    if not isinstance(pool, SlotPool):
        raise TypeError(f"pool must be a SlotPool, got {type(pool).__name__}")
    given = sorted(name for name, value in settings.items() if value is not None)
    if given:
        raise ValueError(
            f"{', '.join(given)} {'belongs' if len(given) == 1 else 'belong'} to the shared pool (its device "
            f"{pool.device}, mode {pool.mode!r}); "
            f"build the SlotPool with them instead of passing them beside pool="
        )


def _check_cache_size(cache_size: object, num_experts: int) -> None:
    if cache_size is None:
        raise ValueError("cache_size (the number of GPU slots) is required")
    if not 1 <= check_int("cache_size", cache_size) <= num_experts:
        raise ValueError(
            f"cache_size must be between 1 and the number of local experts ({num_experts}), got {cache_size}"
        )
