"""Routing of the grouped expert apply: (token, choice) pairs grouped by id into padded blocks.

Pair ``p = t*K + k`` goes to bucket ``b`` = its id when ``0 <= id < N``, else ``N`` (ids that
contribute nothing). Each bucket's pairs fill whole blocks of ``BLOCK_M`` rows, in pair order
(a stable counting sort), the last block padded; buckets follow each other in order. Two
Triton launches and one cumsum, fixed shapes, no host sync (CUDA-graph capturable), with
``C = ceil(P / CHUNK)`` programs::

    count   grid (C,):  counts[b, c] = pairs of chunk c in bucket b             (tl.histogram)
    cumsum  torch:      prefix[b, c] = counts[b, 0..c] summed; prefix[:, C-1] = bucket sizes
    place   grid (C,):  row of pair p = first_block[b] * BLOCK_M + pairs of b in earlier
                        chunks + earlier pairs of b in this chunk; then blocks c*CHUNK ...
                        (c+1)*CHUNK - 1: their bucket (-1 past the used ones), padding rows

`sort_pairs_by_expert_torch` is the reference (a stable torch.sort); both give identical
tensors. The number of blocks is `max_blocks`, a bound from shapes alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import check_num_warps, on_device

#: Elements of the place kernel's ``[CHUNK, NUM_BINS]`` tiles (CHUNK pairs per program), and its
#: warps. (Run 55 of benchmarks/bench_routing_launches.py: 8 warps took 0.76-0.85 of this time at
#: 64 slots (128 bins) and were neutral at 32 and 768 slots; not yet the default: no whole GPU
#: suite has run with it.)
_TILE_ELEMENTS, _NUM_WARPS = 16384, 4


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
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, num_chunks, CHUNK: tl.constexpr, NUM_BINS: tl.constexpr):
    chunk = tl.program_id(0)
    buckets = _buckets(ids_ptr, chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK), num_pairs, num_experts, NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    counts = tl.where(bins == NUM_BINS - 1, 0, tl.histogram(buckets, NUM_BINS))
    tl.store(counts_ptr + bins * num_chunks + chunk, counts)


@triton.jit
def _place_kernel(
    ids_ptr, counts_ptr, prefix_ptr, pair_ptr, expert_ptr, num_pairs, num_experts, num_chunks, num_blocks,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, NUM_BINS: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    bins = tl.arange(0, NUM_BINS)
    lanes = tl.arange(0, CHUNK)
    sizes = tl.load(prefix_ptr + bins * num_chunks + num_chunks - 1)  # pairs per bucket
    blocks = (sizes + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    # this chunk's pairs: rank among the same bucket's pairs, before and in this chunk
    pairs = chunk.to(tl.int64) * CHUNK + lanes
    buckets = _buckets(ids_ptr, pairs, num_pairs, num_experts, NUM_BINS)
    here = tl.sum(((buckets[:, None] == buckets[None, :]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), axis=1)
    cell = buckets * num_chunks + chunk
    before = tl.load(prefix_ptr + cell) - tl.load(counts_ptr + cell)
    first_block = tl.sum(tl.where(bins[None, :] < buckets[:, None], blocks[None, :], 0), axis=1)
    rows = first_block.to(tl.int64) * BLOCK_M + before + here
    tl.store(pair_ptr + rows, pairs, mask=pairs < num_pairs)
    # blocks chunk*CHUNK ...: their bucket, and padding for the rows no pair fills
    block = chunk * CHUNK + lanes
    bucket = tl.sum((block_end[None, :] <= block[:, None]).to(tl.int32), axis=1)  # NUM_BINS past the used blocks
    tl.store(expert_ptr + block, tl.where(bucket <= num_experts, bucket, -1).to(tl.int64), mask=block < num_blocks)
    first = tl.sum(tl.where(bins[None, :] < bucket[:, None], blocks[None, :], 0), axis=1)
    size = tl.sum(tl.where(bins[None, :] == bucket[:, None], sizes[None, :], 0), axis=1)
    members = tl.arange(0, BLOCK_M)[None, :]
    pad = ((block - first)[:, None] * BLOCK_M + members >= size[:, None]) & (block < num_blocks)[:, None]
    padding = tl.zeros([CHUNK, BLOCK_M], dtype=tl.int64) + num_pairs
    tl.store(pair_ptr + block.to(tl.int64)[:, None] * BLOCK_M + members, padding, mask=pad)


def sort_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, num_warps: int | None = None
) -> GroupedRouting:
    """Group the (token, choice) pairs of ``topk_ids`` ``[T, K]`` (int32/int64) by id into
    blocks of ``block_m`` rows (see the module docstring); at least one pair. ``num_warps``:
    the place kernel's (default: `_NUM_WARPS`, measured)."""
    check_num_warps(num_warps)
    ids = topk_ids.contiguous()
    num_pairs, device = ids.numel(), ids.device
    num_bins = triton.next_power_of_2(num_experts + 2)  # buckets 0..N and a spare bin
    chunk = max(16, min(128, _TILE_ELEMENTS // num_bins))  # [CHUNK, NUM_BINS], [CHUNK, CHUNK] tiles stay small
    num_chunks, num_blocks = triton.cdiv(num_pairs, chunk), max_blocks(num_pairs, num_experts, block_m)
    counts = torch.empty(num_bins, num_chunks, dtype=torch.int32, device=device)  # scanned along rows: in parallel
    pair_of_row = torch.empty(num_blocks * block_m, dtype=torch.int64, device=device)
    expert_of_block = torch.empty(num_blocks, dtype=torch.int64, device=device)
    with on_device(device):
        _count_kernel[(num_chunks,)](ids, counts, num_pairs, num_experts, num_chunks, CHUNK=chunk, NUM_BINS=num_bins)
        prefix = torch.cumsum(counts, 1, dtype=torch.int32)
        _place_kernel[(num_chunks,)](
            ids, counts, prefix, pair_of_row, expert_of_block, num_pairs, num_experts, num_chunks, num_blocks,
            BLOCK_M=block_m, CHUNK=chunk, NUM_BINS=num_bins, num_warps=num_warps or _NUM_WARPS,
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
