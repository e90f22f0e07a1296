"""Routing of the grouped expert apply: (token, choice) pairs grouped by id into padded blocks.

Pair ``p = t*K + k`` goes to bucket ``b`` = its id when ``0 <= id < N``, else ``N`` (ids that
contribute nothing). Each bucket's pairs fill whole blocks of ``BLOCK_M`` rows, in pair order
(a stable counting sort), the last block padded; buckets follow each other in order. Fixed
shapes, no host sync (CUDA-graph capturable). The pairs are cut into ``C = ceil(P / CHUNK)``
chunks; a call of one chunk (a decode batch) is sorted by one program in one launch, a larger
one by two launches of ``C`` programs and a cumsum::

    one program (C = 1):
        sizes   = histogram of the chunk                          (tl.histogram)
        rows    = first_block[b] * BLOCK_M + earlier pairs of b in the chunk
        then every block (at most P of them: one chunk): its bucket (-1 past the used ones),
        padding rows
    C programs:
        count   grid (C,):  counts[b, c] = pairs of chunk c in bucket b
        cumsum  torch:      prefix[b, c] = counts[b, 0..c] summed; prefix[:, C-1] = bucket sizes
        place   grid (C,):  chunk c's rows as above, plus the pairs of b in chunks before c
                            (prefix - counts); then blocks c*CHUNK ... (c+1)*CHUNK - 1

Both write identical tensors. `sort_pairs_by_expert_torch` is the reference (a stable
torch.sort). The number of blocks is `max_blocks`, a bound from shapes alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import check_num_warps, on_device

#: Elements of the ``[CHUNK, NUM_BINS]`` tiles (CHUNK pairs a step).
_TILE_ELEMENTS = 16384


class SortLaunch(NamedTuple):
    """How `sort_pairs_by_expert` launches for a call's shape (`sort_launch`)."""

    num_bins: int  # buckets 0..N and a spare bin, to a power of two
    chunk: int  # pairs a step: [CHUNK, NUM_BINS] and [CHUNK, CHUNK] tiles stay small
    num_chunks: int
    one_program: bool
    num_warps: int


def sort_launch(
    num_pairs: int, num_experts: int, num_warps: int | None = None, one_program: bool | None = None
) -> SortLaunch:
    """The launch of a sort of ``num_pairs`` pairs over ``num_experts`` ids; ``None`` takes
    the measured defaults, one program for a call of one chunk and 8 warps. (Runs 57 and 61
    of benchmarks/bench_routing_launches.py, graphed, us a call: B=16 at top-8 over 64 slots,
    one chunk, 8.2 in one program at 8 warps (14.0 / 11.0 / 9.3 at 2 / 4 / 16), 11.1 in C
    programs at 8, 17.0 at 4 (the old default); over 32 slots 7.8 in one program (6.8 at 16
    warps), 9.4 / 10.6 in C programs at 8 / 4; in C programs at 2-32 chunks 8 warps took
    0.64-0.93 of 4 warps' time; a program walking the chunks in turn took 1.8-3.3x of C
    programs at 2-4 chunks and 7-60x at 8-32, so one program sorts one chunk only.) Refuses
    a bad setting, and one program past one chunk (ValueError)."""
    check_num_warps(num_warps)
    if one_program is not None and not isinstance(one_program, bool):
        raise ValueError(f"one_program must be None, True or False, got {one_program!r}")
    num_bins = triton.next_power_of_2(num_experts + 2)
    chunk = max(16, min(128, _TILE_ELEMENTS // num_bins))
    num_chunks = triton.cdiv(num_pairs, chunk)
    if one_program and num_chunks > 1:
        raise ValueError(
            f"one_program sorts a call of one chunk ({chunk} pairs over {num_experts} ids), got {num_pairs} pairs"
        )
    return SortLaunch(num_bins, chunk, num_chunks, num_chunks == 1 if one_program is None else one_program,
                      num_warps or 8)  # fmt: skip


@dataclass(frozen=True)
class GroupedRouting:
    """Where each (token, choice) pair sits in the bucket-sorted, block-padded row space.

    Attributes:
        pair_of_row: ``[num_blocks * block_m]`` int64, the flat pair index ``t*K + k`` each
            row holds, ``T*K`` for padding. Every pair appears once; the pairs of one bucket
            fill its blocks in their original order, padding last.
        expert_of_block: ``[num_blocks]`` int64, the index into ``w1``/``w2`` (expert or
            slot) of every row of the block; ``N`` for a block of pairs whose id is outside
            ``[0, N)``; ``-1`` for blocks past the used ones. Used blocks come first.
        block_m: rows per block.
    """

    pair_of_row: torch.Tensor
    expert_of_block: torch.Tensor
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks a routing uses, from shapes alone.

    With ``m <= min(N + 1, P)`` non-empty buckets (``N`` experts and the invalid bucket)
    holding ``P`` pairs: each block holds at least one pair (``<= P``); each bucket pads by
    at most ``block_m - 1`` rows (``<= (P + m (block_m - 1)) / block_m``).
    """
    buckets = min(num_experts + 1, num_pairs)
    return min(num_pairs, (num_pairs + buckets * (block_m - 1)) // block_m)


@triton.jit
def _buckets(ids_ptr, pairs, num_pairs, num_experts, NUM_BINS: tl.constexpr):
    live = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=live, other=-1).to(tl.int64)
    buckets = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    return tl.where(live, buckets, NUM_BINS - 1).to(tl.int32)  # the last bin (never a bucket) takes lanes past P


@triton.jit
def _bucket_counts(buckets, NUM_BINS: tl.constexpr):
    """``[NUM_BINS]`` pairs in each bucket of ``buckets`` (0 in the spare last bin)."""
    return tl.where(tl.arange(0, NUM_BINS) == NUM_BINS - 1, 0, tl.histogram(buckets, NUM_BINS))


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, num_chunks, CHUNK: tl.constexpr, NUM_BINS: tl.constexpr):
    chunk = tl.program_id(0)
    buckets = _buckets(ids_ptr, chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK), num_pairs, num_experts, NUM_BINS)
    tl.store(counts_ptr + tl.arange(0, NUM_BINS) * num_chunks + chunk, _bucket_counts(buckets, NUM_BINS))


@triton.jit
def _chunk_rows(pair_ptr, pairs, buckets, before, blocks, num_pairs,
                BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    """Store the rows of one chunk's ``pairs`` ``[CHUNK]`` (int64), given their ``buckets``,
    ``before`` (pairs of each one's bucket in earlier chunks) and ``blocks`` ``[NUM_BINS]``
    (blocks per bucket)."""
    bins = tl.arange(0, NUM_BINS)
    lanes = tl.arange(0, CHUNK)
    here = tl.sum(((buckets[:, None] == buckets[None, :]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), axis=1)
    first_block = tl.sum(tl.where(bins[None, :] < buckets[:, None], blocks[None, :], 0), axis=1)
    rows = first_block.to(tl.int64) * BLOCK_M + before + here
    tl.store(pair_ptr + rows, pairs, mask=pairs < num_pairs)


@triton.jit
def _chunk_blocks(pair_ptr, expert_ptr, chunk, sizes, blocks, num_pairs, num_experts, num_blocks,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, NUM_BINS: tl.constexpr):  # fmt: skip
    """Blocks ``chunk*CHUNK ...``: their bucket (-1 past the used ones), and padding for the
    rows no pair fills; ``sizes`` and ``blocks`` ``[NUM_BINS]``: pairs and blocks per bucket."""
    bins = tl.arange(0, NUM_BINS)
    block = chunk * CHUNK + tl.arange(0, CHUNK)
    block_end = tl.cumsum(blocks, 0)
    bucket = tl.sum((block_end[None, :] <= block[:, None]).to(tl.int32), axis=1)  # NUM_BINS past the used blocks
    tl.store(expert_ptr + block, tl.where(bucket <= num_experts, bucket, -1).to(tl.int64), mask=block < num_blocks)
    first = tl.sum(tl.where(bins[None, :] < bucket[:, None], blocks[None, :], 0), axis=1)
    size = tl.sum(tl.where(bins[None, :] == bucket[:, None], sizes[None, :], 0), axis=1)
    members = tl.arange(0, BLOCK_M)[None, :]
    pad = ((block - first)[:, None] * BLOCK_M + members >= size[:, None]) & (block < num_blocks)[:, None]
    padding = tl.zeros([CHUNK, BLOCK_M], dtype=tl.int64) + num_pairs
    tl.store(pair_ptr + block.to(tl.int64)[:, None] * BLOCK_M + members, padding, mask=pad)


@triton.jit
def _place_kernel(
    ids_ptr, counts_ptr, prefix_ptr, pair_ptr, expert_ptr, num_pairs, num_experts, num_chunks, num_blocks,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, NUM_BINS: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    sizes = tl.load(prefix_ptr + tl.arange(0, NUM_BINS) * num_chunks + num_chunks - 1)  # pairs per bucket
    blocks = (sizes + BLOCK_M - 1) // BLOCK_M
    pairs = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    buckets = _buckets(ids_ptr, pairs, num_pairs, num_experts, NUM_BINS)
    cell = buckets * num_chunks + chunk
    before = tl.load(prefix_ptr + cell) - tl.load(counts_ptr + cell)  # this bucket's pairs in earlier chunks
    _chunk_rows(pair_ptr, pairs, buckets, before, blocks, num_pairs, BLOCK_M, CHUNK, NUM_BINS)
    _chunk_blocks(pair_ptr, expert_ptr, chunk, sizes, blocks, num_pairs, num_experts, num_blocks, BLOCK_M, CHUNK,
                  NUM_BINS)  # fmt: skip


@triton.jit
def _sort_one_chunk_kernel(
    ids_ptr, pair_ptr, expert_ptr, num_pairs, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, NUM_BINS: tl.constexpr,
):  # fmt: skip
    pairs = tl.arange(0, CHUNK).to(tl.int64)
    buckets = _buckets(ids_ptr, pairs, num_pairs, num_experts, NUM_BINS)
    sizes = _bucket_counts(buckets, NUM_BINS)
    blocks = (sizes + BLOCK_M - 1) // BLOCK_M
    _chunk_rows(pair_ptr, pairs, buckets, 0, blocks, num_pairs, BLOCK_M, CHUNK, NUM_BINS)
    # num_blocks <= num_pairs <= CHUNK: the blocks are one chunk too
    _chunk_blocks(pair_ptr, expert_ptr, 0, sizes, blocks, num_pairs, num_experts, num_blocks, BLOCK_M, CHUNK,
                  NUM_BINS)  # fmt: skip


def sort_pairs_by_expert(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    num_warps: int | None = None,
    one_program: bool | None = None,
) -> GroupedRouting:
    """Group the (token, choice) pairs of ``topk_ids`` ``[T, K]`` (int32/int64) by id into
    blocks of ``block_m`` rows (see the module docstring); at least one pair.
    ``num_warps``, ``one_program``: the launch (`sort_launch`; None: the measured default).
    Every setting gives the same tensors."""
    ids = topk_ids.contiguous()
    num_pairs, device = ids.numel(), ids.device
    launch = sort_launch(num_pairs, num_experts, num_warps, one_program)
    num_chunks, num_blocks = launch.num_chunks, max_blocks(num_pairs, num_experts, block_m)
    pair_of_row = torch.empty(num_blocks * block_m, dtype=torch.int64, device=device)
    expert_of_block = torch.empty(num_blocks, dtype=torch.int64, device=device)
    shape = dict(BLOCK_M=block_m, CHUNK=launch.chunk, NUM_BINS=launch.num_bins)
    with on_device(device):
        if launch.one_program:
            _sort_one_chunk_kernel[(1,)](
                ids, pair_of_row, expert_of_block, num_pairs, num_experts, num_blocks, **shape,
                num_warps=launch.num_warps,
            )  # fmt: skip
        else:
            counts = torch.empty(launch.num_bins, num_chunks, dtype=torch.int32, device=device)  # scanned along rows
            _count_kernel[(num_chunks,)](
                ids, counts, num_pairs, num_experts, num_chunks, CHUNK=launch.chunk, NUM_BINS=launch.num_bins
            )
            prefix = torch.cumsum(counts, 1, dtype=torch.int32)
            _place_kernel[(num_chunks,)](
                ids, counts, prefix, pair_of_row, expert_of_block, num_pairs, num_experts, num_chunks, num_blocks,
                **shape, num_warps=launch.num_warps,
            )  # fmt: skip
    return GroupedRouting(pair_of_row, expert_of_block, block_m)


def sort_pairs_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> GroupedRouting:
    """Reference of `sort_pairs_by_expert` in torch ops (a stable sort; also graph-capturable)."""
    ids = topk_ids.reshape(-1).long()
    num_pairs, device = ids.numel(), ids.device
    bucket = ids.masked_fill((ids < 0) | (ids >= num_experts), num_experts)
    sorted_bucket, order = torch.sort(bucket, stable=True)
    first = torch.searchsorted(sorted_bucket, torch.arange(num_experts + 2, device=device))  # bucket starts
    blocks = (first[1:] - first[:-1] + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    rank = torch.arange(num_pairs, device=device) - first[sorted_bucket]
    row = (block_end - blocks)[sorted_bucket] * block_m + rank
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    pair_of_row = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    pair_of_row.scatter_(0, row, order)
    expert_of_block = torch.searchsorted(block_end, torch.arange(num_blocks, device=device), right=True)
    return GroupedRouting(pair_of_row, expert_of_block.masked_fill(expert_of_block > num_experts, -1), block_m)
