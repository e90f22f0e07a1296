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
* More distinct local experts than slots (a prefill): the experts are served in groups of
  at most ``num_slots``, in first-appearance order, one ``prepare`` per group. Each
  expert still meets the same rows in the same order, so the result is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from expertcache.cached_provider import CachedWeightProvider
from expertcache.errors import CacheCapacityError
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
        self._local_of_global = partition.expert_map(rank).numpy().astype(np.int64)

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
        try:
            result = self.provider.prepare(call_ids)
        except CacheCapacityError:
            return self._outputs_in_groups(hidden, topk_ids, pending)
        _wait(pending)
        slot_ids = torch.where(topk_ids == -1, -1, result.topk_ids)
        return expert_outputs(hidden, result.w1, result.w2, slot_ids, activation=self.activation)

    def _outputs_in_groups(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, pending: PendingWork | None
    ) -> torch.Tensor:
        group_of, leaders = self._groups(topk_ids)
        group_table = torch.from_numpy(group_of).to(self.device)
        groups = group_table[topk_ids.clamp(min=0).long()].masked_fill(topk_ids < 0, -1)
        out = None
        for group, leader in enumerate(leaders):
            member = groups == group
            # Every other id becomes the group's leader, so the call admits only the group.
            result = self.provider.prepare(torch.where(member, topk_ids, leader))
            _wait(pending)
            slot_ids = torch.where(member, result.topk_ids, -1)
            part = expert_outputs(hidden, result.w1, result.w2, slot_ids, activation=self.activation)
            out = part if out is None else torch.where(member.unsqueeze(-1), part, out)
        assert out is not None  # only reached with more local experts than slots
        return out

    def _groups(self, topk_ids: torch.Tensor) -> tuple[np.ndarray, list[int]]:
        """The group of each global id this call uses (``[E]`` int64, -1: none of mine)
        and each group's first expert."""
        flat = topk_ids.reshape(-1).cpu().numpy()
        flat = flat[flat >= 0]
        mine = flat[self._local_of_global[flat] >= 0]
        _, first = np.unique(mine, return_index=True)
        in_order = mine[np.sort(first)]
        size = self.provider.pool.num_slots
        group_of = np.full(self.partition.num_experts, -1, dtype=np.int64)
        group_of[in_order] = np.arange(in_order.size) // size
        return group_of, in_order[::size].tolist()


def _fill_skips(topk_ids: torch.Tensor) -> torch.Tensor:
    # -1 entries take the call's largest id, which the call uses anyway (or 0 when every
    # entry is -1: a call with nothing to compute then looks up one expert). Other ids
    # outside the layer stay, for the provider to judge.
    fill = topk_ids.max().clamp(min=0) if topk_ids.numel() else topk_ids.new_zeros(())
    return torch.where(topk_ids == -1, fill, topk_ids)


def _wait(pending: PendingWork | None) -> None:
    if pending is not None:
        pending.wait()
