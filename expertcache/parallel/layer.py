"""`ExpertParallelMoE`: one MoE layer whose experts are spread over the ranks of a group.

Each rank holds its own tokens (``T_r`` of them; the attention before the MoE is data
parallel) and only its own experts, behind its own slot cache (`LocalExperts`). One call::

    T_max = max_r T_r                                  all-reduce (host reads it)
    ids    [R*T_max, K] <- every rank's topk_ids      all-gather (padded with -1)
    hidden [R*T_max, H] <- every rank's tokens        all-gather, asynchronous ...
    y      [R*T_max, K, H] = LocalExperts.outputs     ... its misses are copied meanwhile
                                                       (or held back: `CopyPacer`)
    mine   [R, T_max, K, H] <- block s from rank s    all-to-all
    y_tk   = mine[owner(topk_ids[t, k]), t, k]        selection, no arithmetic
    out    = combine_expert_outputs(y_tk, topk_weights)  the reference's k-order sum

Why the output equals the single-process layer bit for bit (fp32 on the CPU): the
single-process reference over all ranks' tokens concatenated computes each ``y_tk`` from
the same rows of the same expert in the same order as the owning rank does here (padding
rows are -1 and join no expert's rows), and each (token, choice) has exactly one owner,
whose ``y_tk`` is *selected*, not summed with the other ranks' zeros. The weighted sum over
``k`` then runs on the token's own rank, in k order, exactly as in `moe_forward`. Summing
per-rank partial outputs instead would add the ``R`` partials in another order and differ
in the last bits. The price is returning ``[T, K, H]`` instead of ``[T, H]`` (K times the
bytes of a reduce); for decode batches that is a few hundred KB.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from expertcache.parallel.collectives import (
    exchange_rows,
    gather_rows,
    max_over_ranks,
    rank_and_size,
)
from expertcache.parallel.local import LocalExperts
from expertcache.parallel.pacing import DEFAULT_CHUNK_BYTES, CopyPacer
from expertcache.reference import combine_expert_outputs
from expertcache.stats import CacheStats


class ExpertParallelMoE:
    """An MoE layer over a process group, each rank serving its experts from its cache.

    Args:
        local: this rank's experts (`LocalExperts` built for this rank of a partition
            whose ``world_size`` equals the group's).
        group: the process group (None: the default group, which must be initialised).
        pacing: hold expert copies while the token all-gather is in flight (default off;
            engaged only with more than one rank; see `CopyPacer`).
        pacing_chunk_bytes: copy chunk size when pacing.
    """

    def __init__(
        self,
        local: LocalExperts,
        *,
        group: dist.ProcessGroup | None = None,
        pacing: bool = False,
        pacing_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        rank, world_size = rank_and_size(group)
        if (local.rank, local.partition.world_size) != (rank, world_size):
            raise ValueError(
                f"local experts were built for rank {local.rank} of "
                f"{local.partition.world_size}, but this process is rank {rank} of {world_size}"
            )
        self.local = local
        self.group = group
        self.pacer = CopyPacer(world_size=world_size, enabled=pacing, chunk_bytes=pacing_chunk_bytes)
        self.pacer.install(local.provider.pool)
        owners = torch.from_numpy(local.partition.owners())
        self._owner_of = owners.to(local.device)

    # -- read-only views -------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.local.rank

    @property
    def world_size(self) -> int:
        return self.local.partition.world_size

    @property
    def stats(self) -> CacheStats:
        """This rank's cache counters (`expertcache.parallel.gather_stats` for all ranks)."""
        return self.local.stats

    def resident_experts(self) -> frozenset[int]:
        """Global ids of this rank's experts that hold a slot now."""
        return self.local.resident_experts()

    # -- the call --------------------------------------------------------------------------

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's tokens through the layer; every rank of the group must call it.

        Args:
            hidden: ``[T_r, H]`` this rank's tokens on the layer's device (``T_r`` may
                differ between ranks, and be 0).
            topk_weights: ``[T_r, K]`` router weights.
            topk_ids: ``[T_r, K]`` int32/int64 global expert ids in ``[-1, E)``; -1 = skip.

        Returns:
            ``[T_r, H]`` in ``hidden``'s dtype, equal to `moe_forward` of the full layer on
            these rows of all ranks' tokens concatenated in rank order.
        """
        _check_inputs(hidden, topk_weights, topk_ids)
        tokens = hidden.shape[0]
        rows = max_over_ranks(tokens, device=self.local.device, group=self.group)
        if rows == 0:
            return hidden.new_zeros(hidden.shape)
        all_ids, _ = gather_rows(topk_ids, rows, fill=-1, group=self.group)
        all_hidden, work = gather_rows(hidden, rows, fill=0.0, group=self.group, async_op=True)
        assert work is not None
        if self.pacer.engaged:
            self.pacer.track(work)
        try:
            per_choice = self.local.outputs(all_hidden, all_ids, pending=work)
        finally:
            self.pacer.release()
        received = exchange_rows(per_choice, group=self.group)[:, :tokens]  # [R, T_r, K, H]
        owner = self._owner_of[topk_ids.clamp(min=0).long()]  # -1 ids: every rank sent zeros
        index = owner[None, :, :, None].expand(1, *received.shape[1:])
        mine = received.gather(0, index)[0]
        return combine_expert_outputs(mine, topk_weights)


def _check_inputs(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    # Metadata only: every rank's provider judges the same gathered ids, so all ranks treat
    # an id outside the layer alike (none is left waiting in a collective).
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T, K]"
        )
    if topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"{topk_ids.shape[0]} routing rows for {hidden.shape[0]} tokens")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
