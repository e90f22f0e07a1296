"""`ExpertParallelMoE`: one MoE layer whose experts are spread over the ranks of a group.

Each rank holds its own tokens (``T_r`` of them; the attention before the MoE is data
parallel) and only its own experts, behind its own slot cache (`LocalExperts`). One call::

    T_max = max_r T_r, every rank's verdict            all-reduce (host reads it)
    ids    [R*T_max, K] <- every rank's topk_ids      all-gather (int64, padded with -1)
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

Bad input changes nothing on any rank: each rank checks its own inputs (types, shapes,
dtypes, devices) before any collective, and the first all-reduce carries every rank's
verdict, its ids' range check and the figures that must be equal on all ranks (the
partition's expert count and scheme, K, H, hidden's dtype; `expertcache.parallel.agreement`),
so every rank raises a Python error, none waits forever and gloo never aborts on blocks of
different sizes. A failure after the cache has served the call (a collective that breaks,
memory running out) leaves what the cache committed: each of the provider's passes is
atomic, the call as a whole is not. The slots then hold the experts they are booked for,
so the next call computes as the reference does, when the ranks' collectives are still in
step: after an error on every rank alike before the all-to-all, or on any rank after it
(`tests/test_generator_ep_fixes.py`). A rank that fails alone before the all-to-all (its
own compute, its own memory) leaves the others waiting in it until the group's timeout;
torch.distributed does not recover from that: rebuild the process group.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from expertcache.parallel.agreement import CallShape, agree_on_call
from expertcache.parallel.collectives import PendingWork, exchange_rows, gather_rows, rank_and_size
from expertcache.parallel.inputs import check_router_weights, check_top_k
from expertcache.parallel.local import LocalExperts
from expertcache.parallel.pacing import DEFAULT_CHUNK_BYTES, CopyPacer
from expertcache.reference import combine_expert_outputs
from expertcache.stats import CacheStats
from expertcache.validation import check_flag


class ExpertParallelMoE:
    """An MoE layer over a process group, each rank serving its experts from its cache.

    Args:
        local: this rank's experts (`LocalExperts` built for this rank of a partition
            whose ``world_size`` equals the group's).
        group: the process group (None: the default group, which must be initialised).
        pacing: hold expert copies while the token all-gather is in flight, True or False
            (default off; engaged only with more than one rank; see `CopyPacer`). Only this
            layer's calls are paced: another layer over the same ``local`` copies unpaced.
        pacing_chunk_bytes: copy chunk size when pacing, an int >= 1.
    """

    def __init__(
        self,
        local: LocalExperts,
        *,
        group: dist.ProcessGroup | None = None,
        pacing: bool = False,
        pacing_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if not isinstance(local, LocalExperts):
            raise TypeError(f"local must be a LocalExperts (this rank's experts), got {type(local).__name__}")
        pacing = check_flag("pacing", pacing)
        rank, world_size = rank_and_size(group)
        if (local.rank, local.partition.world_size) != (rank, world_size):
            raise ValueError(
                f"local experts were built for rank {local.rank} of "
                f"{local.partition.world_size}, but this process is rank {rank} of {world_size}"
            )
        self.local = local
        self.group = group
        self.pacer = CopyPacer(world_size=world_size, enabled=pacing, chunk_bytes=pacing_chunk_bytes)
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
            hidden: ``[T_r, H]`` this rank's tokens on the layer's device, in the experts'
                dtype (``T_r`` may differ between ranks, and be 0; ``H`` and the dtype may not).
            topk_weights: ``[T_r, K]`` router weights, in ``hidden``'s dtype or float32.
            topk_ids: ``[T_r, K]`` int32/int64 global expert ids in ``[-1, E)``; -1 = skip.
                Ranks may differ in the ids' dtype, not in ``K``.

        Returns:
            ``[T_r, H]`` in ``hidden``'s dtype, equal to `moe_forward` of the full layer on
            these rows of all ranks' tokens concatenated in rank order. Every call that
            passes the checks counts one call in ``stats.calls`` on every rank, even one in
            which no rank has a token (nothing is looked up or copied then).

        Raises:
            TypeError / ValueError: this rank's inputs do not fit (its own error; ``K`` = 0
                among them), another rank's do not (ValueError naming it), or the ranks
                disagree on the expert partition (``num_experts``, scheme), ``K``, ``H`` or
                hidden's dtype. IndexError: an id outside ``[-1, E)`` on any rank. Every rank
                raises, after one all-reduce and before the cache or any data moves.
        """
        rows = self._agree(hidden, topk_weights, topk_ids)
        tokens = hidden.shape[0]
        if rows == 0:  # no rank has a token: still a call, counted as `LocalExperts` counts an empty one
            self.local.outputs(hidden, topk_ids)
            return hidden.new_zeros(hidden.shape)
        ids = topk_ids.long()  # one dtype for the gather: ranks may hold int32 or int64 ids
        all_ids, _ = gather_rows(ids, rows, fill=-1, group=self.group)
        all_hidden, work = gather_rows(hidden, rows, fill=0.0, group=self.group, async_op=True)
        assert work is not None
        try:
            with self.pacer.pacing(self.local.provider.pool, work):
                per_choice = self.local.outputs(all_hidden, all_ids, pending=work)
        except BaseException:
            _settle(work)
            raise
        received = exchange_rows(per_choice, group=self.group)[:, :tokens]  # [R, T_r, K, H]
        owner = self._owner_of[ids.clamp(min=0)]  # -1 ids: every rank sent zeros
        index = owner[None, :, :, None].expand(1, *received.shape[1:])
        mine = received.gather(0, index)[0]
        return combine_expert_outputs(mine, topk_weights)

    def _agree(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> int:
        """Check this rank's inputs, then share the verdict with every rank (one all-reduce):
        ``T_max``, or the error every rank raises (`agree_on_call`)."""
        refusal = None
        try:
            self.local.check_call(hidden, topk_ids)
            check_top_k(topk_ids)
            check_router_weights(topk_weights, topk_ids, hidden)
        except (TypeError, ValueError) as error:
            refusal = error  # raised after the all-reduce, so that no other rank waits for this one
        shape = None if refusal else CallShape(topk_ids.shape[0], topk_ids.shape[1], hidden.shape[1], hidden.dtype)
        return agree_on_call(
            refusal, shape, None if refusal else topk_ids,
            partition=self.local.partition, rank=self.rank, world_size=self.world_size,
            device=self.local.device, group=self.group,
        )  # fmt: skip


def _settle(work: PendingWork) -> None:
    # The gather may still be writing all_hidden; let it finish before the error unwinds the
    # call (its own failure, if that is the error, was reported already).
    with contextlib.suppress(Exception):
        work.wait()
