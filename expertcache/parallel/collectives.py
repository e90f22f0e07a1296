"""The few torch.distributed collectives expert parallelism needs, on padded row blocks.

Ranks may hold different numbers of tokens; every exchanged tensor is padded to the
step's largest count ``rows`` so that each rank's block has one size::

    gather_rows   [T_r, ...] on every rank       -> [R * rows, ...] (block s = rank s's rows)
    exchange_rows [R * rows, ...] (block s for s) -> [R, rows, ...] (block s = from rank s)

They work with any backend that has all-gather, all-to-all and all-reduce on the tensors'
device: gloo for CPU tensors, NCCL for CUDA tensors.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (the old name warns); older versions lack the new.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class PendingWork(Protocol):
    """A collective still in flight (what ``torch.distributed`` returns with async_op)."""

    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


def rank_and_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group`` (default: the world)."""
    return dist.get_rank(group), dist.get_world_size(group)


def gather_rows(
    tensor: torch.Tensor,
    rows: int,
    *,
    fill: float,
    group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> tuple[torch.Tensor, PendingWork | None]:
    """All-gather every rank's ``[T_r, ...]`` rows, each padded to ``rows`` with ``fill``.

    Args:
        tensor: ``[T_r, ...]`` with ``T_r <= rows``; the trailing shape and dtype must agree
            across ranks.
        rows: the padded block size (the step's largest ``T_r``).
        fill: value of the padding rows.
        group: the process group (None: the world).
        async_op: return before the gather completes (``wait`` the returned work).

    Returns:
        ``([R * rows, ...], work)``: block ``s`` holds rank ``s``'s rows, then padding.
        ``work`` is None unless ``async_op``.
    """
    if tensor.shape[0] > rows:
        raise ValueError(f"{tensor.shape[0]} rows do not fit a block of {rows}")
    padded = tensor.new_full((rows, *tensor.shape[1:]), fill)
    padded[: tensor.shape[0]] = tensor
    world_size = dist.get_world_size(group)
    out = tensor.new_empty((world_size * rows, *tensor.shape[1:]))
    work = _all_gather(out, padded, group=group, async_op=async_op)
    return out, work


def exchange_rows(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-to-all: block ``s`` of ``tensor`` goes to rank ``s``.

    Args:
        tensor: ``[R * rows, ...]``, block ``s`` (rows ``s*rows .. (s+1)*rows``) for rank ``s``.

    Returns:
        ``[R, rows, ...]``: entry ``s`` is the block that rank ``s`` sent to this rank.
    """
    world_size = dist.get_world_size(group)
    out = torch.empty_like(tensor.contiguous())
    dist.all_to_all_single(out, tensor.contiguous(), group=group)
    return out.view(world_size, tensor.shape[0] // world_size, *tensor.shape[1:])
