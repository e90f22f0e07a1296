"""Device-mode LRU admission: one call's ids -> hits, misses, victims, the copy plan, slot ids.

No host sync, fixed shapes (so it replays in a CUDA graph). It makes exactly the decisions
of the host planner (`expertcache.planner`) with the LRU policy:

* keys deduplicated in first-appearance order of the row-major flattened ids;
* every key of the call is stamped ``base + ordinal`` (its first-appearance rank), so
  recency order = calls in order, then first appearance within a call;
* the r-th miss takes the r-th candidate slot in (last use, slot index) order, among slots
  that this call does not need; never-used slots carry last use -1, so free slots go
  first, lowest index first.

It updates the tables (`expertcache.kernels.slot_tables`), writes the plan that the copy
kernel executes, and the slot ids (through the shared `lookup_slots`). A call with more
distinct local experts than slots changes nothing: its ids come out -1, the plan is empty
and the layer's ``overflows`` counter counts it (the host-visible path raises instead).
Given a pass tensor (`expertcache.kernels.passes`), the call is one expert-group pass:
only the positions of that pass, each group at most ``S`` keys, so it always fits.

Two kernels, one contract:

* ``_admit_small_kernel`` (calls of at most ``SMALL_CALL`` ids: decode) deduplicates in
  registers; a hit costs two dependent loads (ids, expert -> slot).
* ``_admit_kernel`` (any size: prefill) deduplicates through a scatter-min table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from expertcache.kernels._launch import chains_launches, runs_on
from expertcache.kernels.passes import in_pass
from expertcache.kernels.remap import lookup_slots
from expertcache.kernels.slot_tables import FIRST_SEEN_EMPTY, SlotTables, add_counts

#: Largest call (T * K ids) served by the register kernel.
SMALL_CALL = 64
_KEY_MAX = tl.constexpr(2**63 - 1)  # Triton kernels read only constexpr globals
_EMPTY = tl.constexpr(FIRST_SEEN_EMPTY)


@triton.jit
def _place_misses(
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_ptr, miss_stamp_ptr,
    base, num_misses, num_slots, BLOCK_SLOTS: tl.constexpr, SLOT_BITS: tl.constexpr,
):  # fmt: skip
    """The r-th listed miss takes the r-th coldest evictable slot; returns evictions."""
    slots = tl.arange(0, BLOCK_SLOTS)
    in_pool = slots < num_slots
    last = tl.load(last_use_ptr + slots, mask=in_pool, other=base)
    evictable = in_pool & (last < base)  # this call's keys are stamped >= base
    # (last use + 1, slot) packed in one int64: free slots (last use -1) sort first
    order = tl.where(evictable, ((last + 1) << SLOT_BITS) | slots.to(tl.int64), _KEY_MAX)
    num_evictions = 0
    for rank in range(0, num_misses):
        coldest = tl.min(order, axis=0)
        victim = (coldest & ((1 << SLOT_BITS) - 1)).to(tl.int32)
        order = tl.where(order == coldest, _KEY_MAX, order)
        old_key = tl.load(slot_to_key_ptr + victim)
        if old_key >= 0:
            tl.store(expert_to_slot_ptr + old_key, -1)
            num_evictions += 1
        key = tl.load(plan_ptr + 3 + 4 * rank)
        tl.store(expert_to_slot_ptr + key, victim)
        tl.store(slot_to_key_ptr + victim, key)
        tl.store(last_use_ptr + victim, tl.load(miss_stamp_ptr + rank))
        tl.store(plan_ptr + 2 + 4 * rank, victim)
        tl.store(plan_ptr + 4 + 4 * rank, old_key)
    return num_evictions


@triton.jit
def _list_miss(plan_ptr, miss_stamp_ptr, miss_ordinal, local, key, stamp, is_miss):
    tl.store(plan_ptr + 1 + 4 * miss_ordinal, local, mask=is_miss)
    tl.store(plan_ptr + 3 + 4 * miss_ordinal, key, mask=is_miss)
    tl.store(miss_stamp_ptr + miss_ordinal, stamp, mask=is_miss)


@triton.jit
def _admit_small_kernel(
    ids_ptr, global_to_local_ptr, out_ptr, miss_out_ptr,
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, clock_ptr, plan_ptr, miss_stamp_ptr, counters_ptr,
    pass_ptr, num_ids, num_global, num_slots, key_offset, layer, pass_index,
    BLOCK_IDS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, SLOT_BITS: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_PASSES: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    if PDL:  # the copy kernel may launch now; it waits for this kernel on the GPU
        gdc_launch_dependents()
    base = tl.load(clock_ptr)
    positions = tl.arange(0, BLOCK_IDS)
    in_bounds = positions < num_ids
    in_call = in_pass(pass_ptr, positions, in_bounds, pass_index, HAS_PASSES)
    local, key, is_local, invalid, slot = lookup_slots(
        ids_ptr, positions, in_call, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
    )
    same = (key[:, None] == key[None, :]) & is_local[:, None] & is_local[None, :]
    earlier = same & (positions[None, :] < positions[:, None])
    is_first = is_local & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    num_unique = tl.sum(is_first.to(tl.int32), axis=0)
    num_invalid = tl.sum(invalid.to(tl.int32), axis=0)
    if num_unique <= num_slots:
        is_miss = is_first & (slot < 0)
        ordinal = tl.cumsum(is_first.to(tl.int32), axis=0) - 1
        miss_ordinal = tl.cumsum(is_miss.to(tl.int32), axis=0) - 1
        num_misses = tl.sum(is_miss.to(tl.int32), axis=0)
        stamp = base + ordinal.to(tl.int64)
        tl.store(last_use_ptr + slot, stamp, mask=is_first & (slot >= 0))
        _list_miss(plan_ptr, miss_stamp_ptr, miss_ordinal, local, key, stamp, is_miss)
        num_evictions = 0
        was_missed = positions < 0
        if num_misses > 0:
            tl.debug_barrier()
            num_evictions = _place_misses(
                expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_ptr, miss_stamp_ptr,
                base, num_misses, num_slots, BLOCK_SLOTS, SLOT_BITS,
            )  # fmt: skip
            tl.debug_barrier()
            # every position of a missed key (first or repeat) takes its first's slot
            missed = same & is_miss[None, :]
            rank = tl.sum(tl.where(missed, miss_ordinal[None, :], 0), axis=1)
            was_missed = tl.sum(missed.to(tl.int32), axis=1) > 0
            slot = tl.where(was_missed, tl.load(plan_ptr + 2 + 4 * rank, mask=was_missed, other=-1), slot)
        if SPLIT:  # hits to out, misses to miss_out
            misses_out = tl.where(was_missed, slot, -1).to(miss_out_ptr.dtype.element_ty)
            tl.store(miss_out_ptr + positions, misses_out, mask=in_bounds)
            slot = tl.where(was_missed, -1, slot)
        tl.store(out_ptr + positions, tl.where(is_local, slot, -1).to(out_ptr.dtype.element_ty), mask=in_bounds)
        tl.store(plan_ptr, num_misses)
        tl.store(clock_ptr, base + num_unique.to(tl.int64))
        calls = tl.where(pass_index == 0, 1, 0)
        add_counts(counters_ptr, layer, num_unique - num_misses, num_misses, num_evictions, calls, num_invalid, 0)
    else:
        tl.store(out_ptr + positions, tl.full([BLOCK_IDS], -1, out_ptr.dtype.element_ty), mask=in_bounds)
        if SPLIT:
            tl.store(miss_out_ptr + positions, tl.full([BLOCK_IDS], -1, miss_out_ptr.dtype.element_ty), mask=in_bounds)
        tl.store(plan_ptr, 0)
        add_counts(counters_ptr, layer, 0, 0, 0, 0, num_invalid, 1)


@triton.jit
def _admit_kernel(
    ids_ptr, global_to_local_ptr, out_ptr,
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, clock_ptr, first_seen_ptr, plan_ptr, miss_stamp_ptr,
    counters_ptr, pass_ptr, num_ids, num_global, num_slots, key_offset, layer, pass_index,
    BLOCK_IDS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, SLOT_BITS: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_PASSES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # the copy kernel may launch now; it waits for this kernel on the GPU
        gdc_launch_dependents()
    base = tl.load(clock_ptr)
    # 1: first position of every key in the call, and how many keys and bad ids there are
    num_invalid = 0
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        in_call = in_pass(pass_ptr, positions, in_bounds, pass_index, HAS_PASSES)
        _, key, is_local, invalid, _ = lookup_slots(
            ids_ptr, positions, in_call, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
        )
        tl.atomic_min(first_seen_ptr + key, positions, mask=is_local)
        num_invalid += tl.sum(invalid.to(tl.int32), axis=0)
    tl.debug_barrier()
    num_unique = 0
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        in_call = in_pass(pass_ptr, positions, in_bounds, pass_index, HAS_PASSES)
        _, key, is_local, _, _ = lookup_slots(
            ids_ptr, positions, in_call, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
        )
        first = tl.load(first_seen_ptr + key, mask=is_local, other=-1)
        num_unique += tl.sum((is_local & (first == positions)).to(tl.int32), axis=0)
    fits = num_unique <= num_slots

    # 2: walk first appearances in order; stamp hits, list misses
    num_misses = 0
    if fits:
        ordinal_base = 0
        for start in range(0, num_ids, BLOCK_IDS):
            positions = start + tl.arange(0, BLOCK_IDS)
            in_bounds = positions < num_ids
            in_call = in_pass(pass_ptr, positions, in_bounds, pass_index, HAS_PASSES)
            local, key, is_local, _, slot = lookup_slots(
                ids_ptr, positions, in_call, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset,
                HAS_MAP,
            )  # fmt: skip
            first = tl.load(first_seen_ptr + key, mask=is_local, other=-1)
            is_first = is_local & (first == positions)
            is_miss = is_first & (slot < 0)
            ordinal = ordinal_base + tl.cumsum(is_first.to(tl.int32), axis=0) - 1
            miss_ordinal = num_misses + tl.cumsum(is_miss.to(tl.int32), axis=0) - 1
            stamp = base + ordinal.to(tl.int64)
            tl.store(last_use_ptr + slot, stamp, mask=is_first & (slot >= 0))
            _list_miss(plan_ptr, miss_stamp_ptr, miss_ordinal, local, key, stamp, is_miss)
            ordinal_base += tl.sum(is_first.to(tl.int32), axis=0)
            num_misses += tl.sum(is_miss.to(tl.int32), axis=0)
    tl.debug_barrier()

    # 3: victims, coldest first
    num_evictions = 0
    if fits and num_misses > 0:
        num_evictions = _place_misses(
            expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_ptr, miss_stamp_ptr,
            base, num_misses, num_slots, BLOCK_SLOTS, SLOT_BITS,
        )  # fmt: skip
    tl.debug_barrier()

    # 4: slot ids out (-1 everywhere when the call does not fit); scratch back to empty
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        in_call = in_pass(pass_ptr, positions, in_bounds, pass_index, HAS_PASSES)
        _, key, is_local, _, slot = lookup_slots(
            ids_ptr, positions, in_call, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
        )
        slot = tl.where(fits, slot, -1)
        tl.store(out_ptr + positions, slot.to(out_ptr.dtype.element_ty), mask=in_bounds)
        tl.store(first_seen_ptr + key, _EMPTY, mask=is_local)

    if fits:
        tl.store(plan_ptr, num_misses)
        tl.store(clock_ptr, base + num_unique.to(tl.int64))
        calls = tl.where(pass_index == 0, 1, 0)
        add_counts(counters_ptr, layer, num_unique - num_misses, num_misses, num_evictions, calls, num_invalid, 0)
    else:
        tl.store(plan_ptr, 0)
        add_counts(counters_ptr, layer, 0, 0, 0, 0, num_invalid, 1)


def admit(
    tables: SlotTables,
    topk_ids: torch.Tensor,
    global_to_local: torch.Tensor | None,
    out: torch.Tensor,
    *,
    num_global: int,
    key_offset: int,
    layer: int,
    passes: torch.Tensor | None = None,
    pass_index: int = 0,
    miss_out: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> None:
    """Admit one call on the device: update ``tables``, write the plan and the slot ids.

    Args:
        tables: the pool's state (updated in place).
        topk_ids: ``[T, K]`` int32/int64 global expert ids, contiguous.
        global_to_local: ``[E_global]`` int32, global id -> local expert or -1; None when the
            map is the identity (no expert parallelism), which saves a dependent load.
        out: ``[T, K]`` int32/int64 contiguous, receives slot ids (-1: not local, invalid id,
            or a call that does not fit).
        num_global: valid ids are ``[0, num_global)``.
        key_offset: first key of this layer.
        layer: row of ``tables.counters`` to count into.
        passes: optional ``[T, K]`` int32 pass of each position (`expertcache.kernels.passes`):
            the call is then only the positions of pass ``pass_index`` (the others come out
            -1 and count nowhere), and only pass 0 counts as a call.
        pass_index: the pass to admit.
        miss_out: optional ``[T, K]`` like ``out``: then ``out`` receives only the hits' slot
            ids and ``miss_out`` only the misses' (-1 elsewhere in each), so the hits can be
            computed while the misses are copied. Calls of at most ``SMALL_CALL`` ids
            without ``passes`` only.
        num_warps: of the launch (default: measured best for the kernel).
    """
    if not runs_on(topk_ids):
        raise RuntimeError("device admission needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    if not (topk_ids.is_contiguous() and out.is_contiguous() and out.shape == topk_ids.shape):
        raise ValueError("topk_ids and out must be contiguous tensors of one shape")
    num_slots = tables.num_slots
    block_slots = max(16, triton.next_power_of_2(num_slots))
    num_ids = topk_ids.numel()
    has_map = global_to_local is not None
    mapping = global_to_local if has_map else topk_ids
    common = dict(BLOCK_SLOTS=block_slots, SLOT_BITS=max(1, (block_slots - 1).bit_length()), HAS_MAP=has_map)
    if passes is not None and (passes.dtype != torch.int32 or passes.shape != topk_ids.shape):
        raise ValueError("passes must be an int32 tensor shaped like topk_ids")
    common["HAS_PASSES"] = passes is not None
    common["PDL"] = chains_launches(topk_ids.device)
    pass_of = passes if passes is not None else out
    state = (tables.expert_to_slot, tables.slot_to_key, tables.last_use, tables.clock)
    if miss_out is not None:
        if num_ids > SMALL_CALL or passes is not None:
            raise ValueError(f"miss_out takes a call of at most {SMALL_CALL} ids without passes")
        if not miss_out.is_contiguous() or miss_out.shape != out.shape or miss_out.dtype != out.dtype:
            raise ValueError("miss_out must be a contiguous tensor like out")
    if num_ids <= SMALL_CALL:
        _admit_small_kernel[(1,)](
            topk_ids, mapping, out, out if miss_out is None else miss_out, *state, tables.plan, tables.miss_stamp,
            tables.counters,
            pass_of, num_ids, num_global, num_slots, key_offset, layer, pass_index,
            BLOCK_IDS=max(16, triton.next_power_of_2(num_ids)), num_warps=num_warps or 4, SPLIT=miss_out is not None,
            **common,
        )  # fmt: skip
    else:
        _admit_kernel[(1,)](
            topk_ids, mapping, out, *state, tables.first_seen, tables.plan, tables.miss_stamp, tables.counters,
            pass_of, num_ids, num_global, num_slots, key_offset, layer, pass_index,
            BLOCK_IDS=min(1024, triton.next_power_of_2(num_ids)),
            num_warps=num_warps or (4 if block_slots <= 1024 else 8), **common,
        )  # fmt: skip


def admit_torch(
    tables: SlotTables,
    topk_ids: torch.Tensor,
    global_to_local: torch.Tensor | None,
    out: torch.Tensor,
    *,
    num_global: int,
    key_offset: int,
    layer: int,
    passes: torch.Tensor | None = None,
    pass_index: int = 0,
    miss_out: torch.Tensor | None = None,
) -> None:
    """Reference of `admit`, one key at a time in Python (same tables, plan and counters)."""
    flat = topk_ids.reshape(-1).tolist()
    in_call = [True] * len(flat) if passes is None else [p == pass_index for p in passes.reshape(-1).tolist()]
    mapping = None if global_to_local is None else global_to_local.tolist()
    keys: list[int | None] = []
    for value, wanted in zip(flat, in_call, strict=True):
        local = -1 if not (wanted and 0 <= value < num_global) else (value if mapping is None else mapping[value])
        keys.append(None if local < 0 else key_offset + local)
    invalid = sum(wanted and not 0 <= value < num_global for value, wanted in zip(flat, in_call, strict=True))
    calls = int(pass_index == 0)
    unique = list(dict.fromkeys(key for key in keys if key is not None))
    row = tables.counters[layer]
    if len(unique) > tables.num_slots:
        out.copy_(torch.full_like(out, -1))
        if miss_out is not None:
            miss_out.copy_(torch.full_like(miss_out, -1))
        tables.plan[0] = 0
        row += torch.tensor([0, 0, 0, 0, invalid, 1], device=row.device)
        return
    e2s, s2k, last = tables.expert_to_slot, tables.slot_to_key, tables.last_use
    base = int(tables.clock[0])
    misses = []
    for ordinal, key in enumerate(unique):
        slot = int(e2s[key])
        if slot >= 0:
            last[slot] = base + ordinal
        else:
            misses.append((key, base + ordinal))
    order = sorted((int(last[s]), s) for s in range(tables.num_slots) if int(last[s]) < base)
    entries = tables.plan_entries()
    evictions = 0
    for rank, ((key, stamp), (_, victim)) in enumerate(zip(misses, order, strict=False)):
        old = int(s2k[victim])
        if old >= 0:
            e2s[old] = -1
            evictions += 1
        e2s[key], s2k[victim], last[victim] = victim, key, stamp
        entries[rank] = torch.tensor([key - key_offset, victim, key, old], dtype=torch.int32)
    tables.plan[0] = len(misses)
    tables.clock[0] = base + len(unique)
    slots = [-1 if key is None else int(e2s[key]) for key in keys]
    if miss_out is not None:
        missed = {key for key, _ in misses}
        miss_slots = [slot if key in missed else -1 for key, slot in zip(keys, slots, strict=True)]
        miss_out.copy_(torch.tensor(miss_slots, dtype=out.dtype).view(out.shape))
        slots = [-1 if key in missed else slot for key, slot in zip(keys, slots, strict=True)]
    out.copy_(torch.tensor(slots, dtype=out.dtype).view(out.shape))
    row += torch.tensor([len(unique) - len(misses), len(misses), evictions, calls, invalid, 0], device=row.device)
