"""Device-side grouping of an oversize call into expert-group passes (`expertcache.passes`).

``assign_passes`` writes, for every position of ``topk_ids``, the pass that serves it,
with no host sync (a CUDA graph captures it)::

    keys in first-appearance order (scatter-min of positions), hits = resident keys
    G = S, or S // 2 for overlapped passes of a call of more than S keys
                (S = the pool's share: `expertcache.layer_shares`)
    pass(key) = r // G for the r-th hit, (hits + r) // G for the r-th missing key
    pass[position] = pass(its key); 0 for ids that are not local or not valid

the same groups as `expertcache.passes.group_passes` on the host. Each pass then runs the
ordinary admission (device mode) or commit (host mode) restricted to its positions:
`in_pass` is the filter those kernels share.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import runs_on, walk_launch
from expertcache.kernels.remap import lookup_slots
from expertcache.kernels.slot_tables import FIRST_SEEN_EMPTY, SlotTables
from expertcache.passes import group_size

_EMPTY = tl.constexpr(FIRST_SEEN_EMPTY)


@triton.jit
def in_pass(pass_ptr, positions, in_bounds, pass_index, HAS_PASSES: tl.constexpr):
    """The positions of a block that belong to pass ``pass_index`` (all, without passes)."""
    if HAS_PASSES:
        return in_bounds & (tl.load(pass_ptr + positions, mask=in_bounds, other=-1) == pass_index)
    else:
        return in_bounds


@triton.jit
def _assign_passes_kernel(
    ids_ptr, global_to_local_ptr, expert_to_slot_ptr, first_seen_ptr, pass_ptr,
    num_ids, num_global, share, overlap_group, key_offset, BLOCK_IDS: tl.constexpr, HAS_MAP: tl.constexpr,
):  # fmt: skip
    # 1: the first position of every key
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        _, key, is_local, _, _ = lookup_slots(
            ids_ptr, positions, in_bounds, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
        )
        tl.atomic_min(first_seen_ptr + key, positions, mask=is_local)
    tl.debug_barrier()
    # 2: how many keys the call has, and how many of them are resident
    num_hits = 0
    num_keys = 0
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        _, key, is_local, _, slot = lookup_slots(
            ids_ptr, positions, in_bounds, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
        )
        first = tl.load(first_seen_ptr + key, mask=is_local, other=-1)
        is_first = is_local & (first == positions)
        num_hits += tl.sum((is_first & (slot >= 0)).to(tl.int32), axis=0)
        num_keys += tl.sum(is_first.to(tl.int32), axis=0)
    size = tl.where(num_keys > share, overlap_group, share)  # `expertcache.passes.group_size`
    # 3: the pass of every first appearance, hits and misses each ranked in first-appearance order
    num_misses = 0
    hits_before = 0
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        _, key, is_local, _, slot = lookup_slots(
            ids_ptr, positions, in_bounds, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
        )
        first = tl.load(first_seen_ptr + key, mask=is_local, other=-1)
        is_first = is_local & (first == positions)
        is_miss = is_first & (slot < 0)
        is_hit = is_first & (slot >= 0)
        rank = num_misses + tl.cumsum(is_miss.to(tl.int32), axis=0) - 1
        hit_rank = hits_before + tl.cumsum(is_hit.to(tl.int32), axis=0) - 1
        group = tl.where(is_miss, (num_hits + rank) // size, hit_rank // size)
        tl.store(pass_ptr + positions, group, mask=is_first)
        num_misses += tl.sum(is_miss.to(tl.int32), axis=0)
        hits_before += tl.sum(is_hit.to(tl.int32), axis=0)
    tl.debug_barrier()
    # 4: every position takes its first appearance's pass (a first keeps its own value)
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        _, key, is_local, _, _ = lookup_slots(
            ids_ptr, positions, in_bounds, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
        )
        first = tl.load(first_seen_ptr + key, mask=is_local, other=0)
        group = tl.load(pass_ptr + first, mask=is_local, other=0)
        tl.store(pass_ptr + positions, tl.where(is_local, group, 0), mask=in_bounds)
    tl.debug_barrier()
    # 5: scratch back to empty
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        _, key, is_local, _, _ = lookup_slots(
            ids_ptr, positions, in_bounds, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
        )
        tl.store(first_seen_ptr + key, _EMPTY, mask=is_local)


def assign_passes(
    tables: SlotTables,
    topk_ids: torch.Tensor,
    global_to_local: torch.Tensor | None,
    out: torch.Tensor,
    *,
    num_global: int,
    key_offset: int,
    overlap: bool = False,
    block_ids: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Write the pass of every position of ``topk_ids`` into ``out``.

    Args:
        tables: the pool's state (read; ``first_seen`` is scratch, left empty).
        topk_ids: ``[T, K]`` int32/int64 global ids, contiguous.
        global_to_local: ``[E_global]`` int32 map, or None for the identity.
        out: ``[T, K]`` int32 contiguous: the pass index per position (0 for ids that no
            pass serves: other ranks' or invalid ones).
        num_global, key_offset: as in `expertcache.kernels.admission.admit`.
        overlap: group as overlapped passes (`expertcache.passes.group_size`).
        block_ids, num_warps: the launch's ids a step (a power of two) and warps (default:
            `expertcache.kernels._launch.walk_launch`).
    """
    if not runs_on(topk_ids):
        raise RuntimeError("assign_passes needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    contiguous = out.is_contiguous() and topk_ids.is_contiguous()
    if out.dtype != torch.int32 or out.shape != topk_ids.shape or not contiguous:
        raise ValueError("out must be a contiguous int32 tensor shaped like the contiguous topk_ids")
    has_map = global_to_local is not None
    block, warps = walk_launch(topk_ids.numel(), block_ids, num_warps)
    oversize_group = group_size(tables.share + 1, tables.share, overlap=overlap)  # of a call that does not fit
    _assign_passes_kernel[(1,)](
        topk_ids, global_to_local if has_map else topk_ids, tables.expert_to_slot, tables.first_seen, out,
        topk_ids.numel(), num_global, tables.share, oversize_group, key_offset,
        BLOCK_IDS=block, HAS_MAP=has_map, num_warps=warps,
    )  # fmt: skip


def assign_passes_torch(
    tables: SlotTables,
    topk_ids: torch.Tensor,
    global_to_local: torch.Tensor | None,
    out: torch.Tensor,
    *,
    num_global: int,
    key_offset: int,
    overlap: bool = False,
) -> None:
    """Reference of `assign_passes`: `expertcache.passes.group_passes` on the host."""
    from expertcache.passes import group_passes

    flat = topk_ids.reshape(-1).tolist()
    mapping = None if global_to_local is None else global_to_local.tolist()
    keys = []
    for value in flat:
        local = -1 if not 0 <= value < num_global else (value if mapping is None else mapping[value])
        keys.append(None if local < 0 else key_offset + local)
    unique = list(dict.fromkeys(key for key in keys if key is not None))
    table = tables.expert_to_slot.tolist()
    groups = group_passes(unique, [table[key] >= 0 for key in unique], tables.share, overlap=overlap)
    group_of = {key: index for index, group in enumerate(groups) for key in group}
    passes = [0 if key is None else group_of[key] for key in keys]
    out.copy_(torch.tensor(passes, dtype=torch.int32).view(out.shape))
