"""`LocalExperts`: one rank's share of an MoE layer, with no communication.

The rank holds only its own experts, behind a `CachedWeightProvider` built with the
partition's ``expert_map``; given every token of the step (all ranks' tokens, global
expert ids) it returns the unweighted output ``y_tk`` of each (token, choice) that one of
its experts serves, and exact zeros elsewhere::

    hidden [N, H], topk_ids [N, K] global  -> provider.prepare -> slot ids (-1: not mine)
                                           -> expert_outputs    -> [N, K, H]

This is the single-rank path of expert parallelism; `ExpertParallelMoE` adds the
collectives around it. It never loads another rank's expert: those ids never reach the
cache (the provider maps them to -1).

Two cases the provider alone does not take:

* ``-1`` ids (padding rows, dropped tokens) skip, as in `moe_forward`: they are replaced by
  the call's largest id before ``prepare`` (an id the call uses anyway, so they add no
  lookup and load nothing) and set back to -1 afterwards. A call whose ids are all -1 (or
  that has none) has nothing to compute: it is served as an empty call (counted in
  ``stats.calls``, nothing looked up, copied or evicted) and returns zeros.
* More distinct local experts than slots (a prefill): the call runs in expert-group passes
  (`expertcache.passes`, the strategy of every runtime path and of the simulator). Each
  expert still meets the same rows in the same order, so the result is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from expertcache.cached_provider import CachedWeightProvider
from expertcache.parallel.collectives import PendingWork
from expertcache.parallel.inputs import (
    check_activation,
    check_full_weights,
    check_hidden,
    check_partition,
    computed_layout,
)
from expertcache.parallel.partition import ExpertPartition
from expertcache.policies import EvictionPolicy
from expertcache.reference import expert_outputs
from expertcache.stats import CacheStats
from expertcache.store import CPUBackingStore
from expertcache.validation import check_id_bounds, check_topk_ids


class LocalExperts:
    """The experts one rank owns, served through its own slot cache.

    Args:
        weights: ``{"w1": [E_local, 2I, H], "w2": [E_local, H, I]}``: this rank's experts in
            the order of ``partition.local_experts(rank)``, one of float16, bfloat16, float32
            or float64 (the pure-torch reference computes in it), or a `CPUBackingStore` of
            them, to share one pinned copy between caches. Other names (scales, biases) are
            refused: the reference would ignore them.
        partition: placement of the layer's experts on the ranks.
        rank: this rank, an int in ``[0, partition.world_size)``.
        cache_size: GPU slots for this rank's experts, ``1 <= cache_size <= E_local``.
        device: where slots and compute live (default: current CUDA device, else CPU).
        policy: eviction policy name or instance.
        activation: ``"silu"`` or ``"gelu"``.
        pin_budget_bytes: passed to the provider's backing store.

    Raises:
        TypeError / ValueError: any argument above that does not fit, before anything is built.
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor] | CPUBackingStore,
        partition: ExpertPartition,
        rank: int,
        *,
        cache_size: int,
        device: str | torch.device | None = None,
        policy: str | EvictionPolicy = "lru",
        activation: str = "silu",
        pin_budget_bytes: int | None = None,
    ) -> None:
        self.partition = check_partition(partition)
        self.rank = partition.check_rank(rank)
        self.activation = check_activation(activation)
        num_local, layout = computed_layout(weights)
        self.global_ids = partition.local_experts(self.rank)
        if num_local != len(self.global_ids):
            raise ValueError(
                f"weights hold {num_local} experts, but rank {self.rank} owns {len(self.global_ids)} under "
                f"{partition} (LocalExperts.from_full_weights picks them from all {partition.num_experts})"
            )
        self.provider = CachedWeightProvider(
            weights,
            cache_size=cache_size,
            device=device,
            policy=policy,
            expert_map=partition.expert_map(self.rank),
            pin_budget_bytes=pin_budget_bytes,
        )
        w1, w2 = (spec for spec in layout.specs if spec.name in ("w1", "w2"))
        self.hidden_size: int = w2.shape[0]
        self.dtype: torch.dtype = w1.dtype

    @classmethod
    def from_full_weights(
        cls, weights: Mapping[str, torch.Tensor], partition: ExpertPartition, rank: int, **kwargs
    ) -> LocalExperts:
        """Build from ``{name: [E, *shape]}`` holding every expert (``E`` =
        ``partition.num_experts``); keeps only ``rank``'s.

        Raises:
            TypeError / ValueError: as the constructor, and a tensor whose first dimension is
                not ``partition.num_experts``.
        """
        check_full_weights(weights, check_partition(partition).num_experts)
        index = torch.tensor(partition.local_experts(rank), dtype=torch.int64)
        local = {name: tensor[index.to(tensor.device)] for name, tensor in weights.items()}
        return cls(local, partition, rank, **kwargs)

    # -- read-only views -------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.provider.device

    @property
    def stats(self) -> CacheStats:
        """This rank's cache counters (an immutable snapshot)."""
        return self.provider.stats

    def resident_experts(self) -> frozenset[int]:
        """Global ids of this rank's experts that hold a slot now."""
        return frozenset(self.global_ids[local] for local in self.provider.resident())

    # -- the call --------------------------------------------------------------------------

    def check_call(self, hidden: object, topk_ids: object) -> None:
        """Raise as `outputs` would for these inputs' metadata, reading no tensor data."""
        ids = check_topk_ids(topk_ids, self.device)
        check_hidden(hidden, tokens=ids.shape[0], hidden_size=self.hidden_size, dtype=self.dtype, device=self.device)

    def outputs(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        pending: PendingWork | None = None,
    ) -> torch.Tensor:
        """Unweighted outputs of every (token, choice) this rank's experts serve.

        Args:
            hidden: ``[N, H]`` tokens on the cache's device, in the weights' dtype.
            topk_ids: ``[N, K]`` int32/int64 global expert ids in ``[-1, E)``; -1 = skip.
            pending: a collective that is still writing ``hidden``; waited for after the
                first ``prepare`` (so expert copies overlap it) and before any compute.

        Returns:
            ``[N, K, H]`` in ``hidden``'s dtype: ``y_tk`` where ``topk_ids[t, k]`` is one of
            this rank's experts, exact zeros elsewhere. Bit-identical to `expert_outputs`
            on the full weights for those entries whenever the device's matmul is
            deterministic for identical inputs.

        Raises:
            TypeError / ValueError: ``hidden`` or ``topk_ids`` of the wrong type, shape,
                dtype or device (``hidden``'s rows must equal ``topk_ids``' rows).
            IndexError: an id outside ``[-1, E)``.
            All of them before the cache changes (one host read of the ids' range).
        """
        self.check_call(hidden, topk_ids)
        call_ids = self._fill_skips(topk_ids)
        if call_ids.numel() == 0:  # nothing to compute: an empty call, counted like any other
            for _ in self.provider.passes(call_ids):
                pass
            _wait(pending)
            return hidden.new_zeros(*topk_ids.shape, self.hidden_size)
        out = None
        results = self.provider.passes(call_ids)
        try:
            for result in results:
                _wait(pending)  # after the first pass's copies are enqueued, before any compute
                pending = None
                slot_ids = torch.where(topk_ids == -1, -1, result.topk_ids)
                part = expert_outputs(hidden, result.w1, result.w2, slot_ids, activation=self.activation)
                out = part if out is None else torch.where((slot_ids >= 0).unsqueeze(-1), part, out)
        finally:
            _close(results)  # an error in the loop ends the provider's call at once, not when collected
        assert out is not None  # a provider yields at least one pass
        return out

    def _fill_skips(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``topk_ids`` with each -1 replaced by the call's largest id, which the call uses
        anyway; ``[0, K]`` when there is nothing to compute (every id -1, or none), so the
        provider serves an empty call and loads nothing.

        Raises:
            IndexError: an id outside ``[-1, E)`` (checked here for the -1 filling's sake:
                the provider's own check would see the filled ids).
        """
        if topk_ids.numel() == 0:
            return topk_ids[:0]
        low, high = torch.stack(torch.aminmax(topk_ids)).tolist()  # the range check's one host read
        check_id_bounds(low, high, self.partition.num_experts, skip_id=True)
        if high == -1:
            return topk_ids[:0]
        # Other ids outside this rank stay: the provider maps them to -1 and loads nothing.
        return torch.where(topk_ids == -1, high, topk_ids)


def _close(results: Iterator[object]) -> None:
    close = getattr(results, "close", None)
    if close is not None:
        close()


def _wait(pending: PendingWork | None) -> None:
    if pending is not None:
        pending.wait()
