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
  an id the call already uses before ``prepare`` (so they add no lookup) and set back to -1
  afterwards, all on the device.
* More distinct local experts than slots (a prefill): the call runs in expert-group passes
  (`expertcache.passes`, the strategy of every runtime path and of the simulator). Each
  expert still meets the same rows in the same order, so the result is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from expertcache.cached_provider import CachedWeightProvider
from expertcache.parallel.collectives import PendingWork
from expertcache.parallel.partition import ExpertPartition
from expertcache.policies import EvictionPolicy
from expertcache.reference import expert_outputs
from expertcache.stats import CacheStats
from expertcache.store import CPUBackingStore


class LocalExperts:
    """The experts one rank owns, served through its own slot cache.

    Args:
        weights: ``{name: [E_local, *shape]}``: this rank's experts in the order of
            ``partition.local_experts(rank)`` (see `CachedWeightProvider` for the names),
            or a `CPUBackingStore` of them, to share one pinned copy between caches.
        partition: placement of the layer's experts on the ranks.
        rank: this rank.
        cache_size: GPU slots for this rank's experts, ``1 <= cache_size <= E_local``.
        device: where slots and compute live (default: current CUDA device, else CPU).
        policy: eviction policy name or instance.
        activation: ``"silu"`` or ``"gelu"``.
        pin_budget_bytes: passed to the provider's backing store.
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
        self.partition = partition
        self.rank = rank
        self.global_ids = partition.local_experts(rank)
        self.activation = activation
        self.provider = CachedWeightProvider(
            weights,
            cache_size=cache_size,
            device=device,
            policy=policy,
            expert_map=partition.expert_map(rank),
            pin_budget_bytes=pin_budget_bytes,
        )

    @classmethod
    def from_full_weights(
        cls, weights: Mapping[str, torch.Tensor], partition: ExpertPartition, rank: int, **kwargs
    ) -> LocalExperts:
        """Build from ``{name: [E, *shape]}`` holding every expert; keeps only ``rank``'s."""
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

    def outputs(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        pending: PendingWork | None = None,
    ) -> torch.Tensor:
        """Unweighted outputs of every (token, choice) this rank's experts serve.

        Args:
            hidden: ``[N, H]`` tokens on the cache's device.
            topk_ids: ``[N, K]`` int32/int64 global expert ids in ``[-1, E)``; -1 = skip.
            pending: a collective that is still writing ``hidden``; waited for after the
                first ``prepare`` (so expert copies overlap it) and before any compute.

        Returns:
            ``[N, K, H]`` in ``hidden``'s dtype: ``y_tk`` where ``topk_ids[t, k]`` is one of
            this rank's experts, exact zeros elsewhere. Bit-identical to `expert_outputs`
            on the full weights for those entries whenever the device's matmul is
            deterministic for identical inputs.
        """
        call_ids = _fill_skips(topk_ids)
        out = None
        for result in self.provider.passes(call_ids):
            _wait(pending)  # after the first pass's copies are enqueued, before any compute
            pending = None
            slot_ids = torch.where(topk_ids == -1, -1, result.topk_ids)
            part = expert_outputs(hidden, result.w1, result.w2, slot_ids, activation=self.activation)
            out = part if out is None else torch.where((slot_ids >= 0).unsqueeze(-1), part, out)
        assert out is not None  # a provider yields at least one pass
        return out


def _fill_skips(topk_ids: torch.Tensor) -> torch.Tensor:
    # -1 entries take the call's largest id, which the call uses anyway (or 0 when every
    # entry is -1: a call with nothing to compute then looks up one expert). Other ids
    # outside the layer stay, for the provider to judge.
    fill = topk_ids.max().clamp(min=0) if topk_ids.numel() else topk_ids.new_zeros(())
    return torch.where(topk_ids == -1, fill, topk_ids)


def _wait(pending: PendingWork | None) -> None:
    if pending is not None:
        pending.wait()
