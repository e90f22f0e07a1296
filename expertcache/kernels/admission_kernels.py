"""The device-mode LRU admission kernels (launched by `expertcache.kernels.admission.admit`,
which states their contract).

* ``_admit_small_kernel`` (calls of at most ``SMALL_CALL`` ids: decode) deduplicates in
  registers; a hit costs two dependent loads (ids, expert -> slot). With ``SPLIT`` it writes
  the hits' and the misses' slot ids to two outputs (an overlapped call).
* ``_admit_kernel`` (any size: prefill) deduplicates through a scatter-min table. With
  ``SPLIT`` it marks each missed key there and writes hits and misses apart, as above.
* With ``HAS_LANDED`` both zero the pass's landing counters and write the full count at
  every hit's slot (`expertcache.kernels.landing`): the copy kernel counts the misses' up.
* Both place the listed misses with ``_place_misses`` (`expertcache.kernels.admission_victims`):
  the r-th miss takes the r-th coldest evictable slot (in a pool of several layers, not one of
  another layer at or below its share).

On sm_90+ both let the copy kernel launch at once (``PDL``: programmatic dependent launch;
the copy kernel waits for them on the GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from expertcache.kernels.admission_victims import _place_misses
from expertcache.kernels.passes import in_pass
from expertcache.kernels.remap import lookup_slots
from expertcache.kernels.slot_tables import FIRST_SEEN_EMPTY, add_counts

_EMPTY = tl.constexpr(FIRST_SEEN_EMPTY)
_MISSED = tl.constexpr(-2)  # first_seen of a key this call missed (SPLIT): no position is negative


@triton.jit
def _block_of_call(
    start, ids_ptr, pass_ptr, pass_index, global_to_local_ptr, expert_to_slot_ptr, num_ids, num_global, key_offset,
    BLOCK_IDS: tl.constexpr, HAS_MAP: tl.constexpr, HAS_PASSES: tl.constexpr,
):  # fmt: skip
    """Positions ``start ..`` of the call (or of its pass ``pass_index``): ``(positions,
    in_bounds, local expert, key, is_local, invalid, slot)`` as `lookup_slots` gives them."""
    positions = start + tl.arange(0, BLOCK_IDS)
    in_bounds = positions < num_ids
    in_call = in_pass(pass_ptr, positions, in_bounds, pass_index, HAS_PASSES)
    local, key, is_local, invalid, slot = lookup_slots(
        ids_ptr, positions, in_call, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
    )
    return positions, in_bounds, local, key, is_local, invalid, slot


@triton.jit
def _clear_landed(landed_ptr, num_slots, BLOCK_SLOTS: tl.constexpr, HAS_LANDED: tl.constexpr):
    """Zero the pass's landing counters (`expertcache.kernels.landing`) before any hit marks its slot."""
    if HAS_LANDED:
        for start in range(0, num_slots, BLOCK_SLOTS):
            slots = start + tl.arange(0, BLOCK_SLOTS)
            tl.store(landed_ptr + slots, tl.zeros([BLOCK_SLOTS], dtype=tl.int32), mask=slots < num_slots)
        tl.debug_barrier()


@triton.jit
def _list_miss(plan_ptr, miss_stamp_ptr, miss_ordinal, local, key, stamp, is_miss):
    tl.store(plan_ptr + 1 + 4 * miss_ordinal, local, mask=is_miss)
    tl.store(plan_ptr + 3 + 4 * miss_ordinal, key, mask=is_miss)
    tl.store(miss_stamp_ptr + miss_ordinal, stamp, mask=is_miss)


@triton.jit
def _admit_small_kernel(
    ids_ptr, global_to_local_ptr, out_ptr, miss_out_ptr,
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, clock_ptr, plan_ptr, miss_stamp_ptr, counters_ptr,
    key_layer_ptr, pass_ptr, landed_ptr, num_ids, num_global, num_slots, key_offset, layer, share, pass_index,
    landed_target,
    BLOCK_IDS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, SLOT_BITS: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_PASSES: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr, HAS_SHARES: tl.constexpr,
    HAS_LANDED: tl.constexpr,
):  # fmt: skip
    if PDL:  # the copy kernel may launch now; it waits for this kernel on the GPU
        gdc_launch_dependents()
    _clear_landed(landed_ptr, num_slots, BLOCK_SLOTS, HAS_LANDED)
    base = tl.load(clock_ptr)
    positions, in_bounds, local, key, is_local, invalid, slot = _block_of_call(
        0, ids_ptr, pass_ptr, pass_index, global_to_local_ptr, expert_to_slot_ptr, num_ids, num_global, key_offset,
        BLOCK_IDS, HAS_MAP, HAS_PASSES,
    )  # fmt: skip
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
        if HAS_LANDED:  # a hit's slot holds its expert already
            tl.store(landed_ptr + slot, landed_target, mask=is_first & (slot >= 0))
        _list_miss(plan_ptr, miss_stamp_ptr, miss_ordinal, local, key, stamp, is_miss)
        num_evictions = 0
        was_missed = positions < 0
        if num_misses > 0:
            tl.debug_barrier()
            num_evictions = _place_misses(
                expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_ptr, miss_stamp_ptr, key_layer_ptr,
                base, num_misses, num_slots, layer, share, BLOCK_SLOTS, SLOT_BITS, HAS_SHARES,
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
        tl.store(clock_ptr, base + num_unique.to(tl.int64))  # type: ignore[attr-defined]  # a tensor in the kernel
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
    ids_ptr, global_to_local_ptr, out_ptr, miss_out_ptr,
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, clock_ptr, first_seen_ptr, plan_ptr, miss_stamp_ptr,
    counters_ptr, key_layer_ptr, pass_ptr, landed_ptr, num_ids, num_global, num_slots, key_offset, layer, share,
    pass_index, landed_target,
    BLOCK_IDS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, SLOT_BITS: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_PASSES: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr, HAS_SHARES: tl.constexpr,
    HAS_LANDED: tl.constexpr,
):  # fmt: skip
    if PDL:  # the copy kernel may launch now; it waits for this kernel on the GPU
        gdc_launch_dependents()
    _clear_landed(landed_ptr, num_slots, BLOCK_SLOTS, HAS_LANDED)
    base = tl.load(clock_ptr)
    # 1: first position of every key in the call, and how many keys and bad ids there are
    num_invalid = 0
    for start in range(0, num_ids, BLOCK_IDS):
        positions, in_bounds, _, key, is_local, invalid, _ = _block_of_call(
            start, ids_ptr, pass_ptr, pass_index, global_to_local_ptr, expert_to_slot_ptr, num_ids, num_global,
            key_offset, BLOCK_IDS, HAS_MAP, HAS_PASSES,
        )  # fmt: skip
        tl.atomic_min(first_seen_ptr + key, positions, mask=is_local)
        num_invalid += tl.sum(invalid.to(tl.int32), axis=0)
    tl.debug_barrier()
    num_unique = 0
    for start in range(0, num_ids, BLOCK_IDS):
        positions, in_bounds, _, key, is_local, _, _ = _block_of_call(
            start, ids_ptr, pass_ptr, pass_index, global_to_local_ptr, expert_to_slot_ptr, num_ids, num_global,
            key_offset, BLOCK_IDS, HAS_MAP, HAS_PASSES,
        )  # fmt: skip
        first = tl.load(first_seen_ptr + key, mask=is_local, other=-1)
        num_unique += tl.sum((is_local & (first == positions)).to(tl.int32), axis=0)
    fits = num_unique <= num_slots

    # 2: walk first appearances in order; stamp hits, list misses
    num_misses = 0
    if fits:
        ordinal_base = 0
        for start in range(0, num_ids, BLOCK_IDS):
            positions, in_bounds, local, key, is_local, _, slot = _block_of_call(
                start, ids_ptr, pass_ptr, pass_index, global_to_local_ptr, expert_to_slot_ptr, num_ids, num_global,
                key_offset, BLOCK_IDS, HAS_MAP, HAS_PASSES,
            )  # fmt: skip
            first = tl.load(first_seen_ptr + key, mask=is_local, other=-1)
            is_first = is_local & (first == positions)
            is_miss = is_first & (slot < 0)
            ordinal = ordinal_base + tl.cumsum(is_first.to(tl.int32), axis=0) - 1
            miss_ordinal = num_misses + tl.cumsum(is_miss.to(tl.int32), axis=0) - 1
            stamp = base + ordinal.to(tl.int64)
            tl.store(last_use_ptr + slot, stamp, mask=is_first & (slot >= 0))
            if HAS_LANDED:  # a hit's slot holds its expert already
                tl.store(landed_ptr + slot, landed_target, mask=is_first & (slot >= 0))
            _list_miss(plan_ptr, miss_stamp_ptr, miss_ordinal, local, key, stamp, is_miss)
            if SPLIT:  # a missed key's first position is no longer needed: mark the key missed
                tl.store(first_seen_ptr + key, _MISSED, mask=is_miss)
            ordinal_base += tl.sum(is_first.to(tl.int32), axis=0)
            num_misses += tl.sum(is_miss.to(tl.int32), axis=0)
    tl.debug_barrier()

    # 3: victims, coldest first
    num_evictions = 0
    if fits and num_misses > 0:
        num_evictions = _place_misses(
            expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_ptr, miss_stamp_ptr, key_layer_ptr,
            base, num_misses, num_slots, layer, share, BLOCK_SLOTS, SLOT_BITS, HAS_SHARES,
        )  # fmt: skip
    tl.debug_barrier()

    # 4: slot ids out (-1 everywhere when the call does not fit); scratch back to empty
    for start in range(0, num_ids, BLOCK_IDS):
        positions, in_bounds, _, key, is_local, _, slot = _block_of_call(
            start, ids_ptr, pass_ptr, pass_index, global_to_local_ptr, expert_to_slot_ptr, num_ids, num_global,
            key_offset, BLOCK_IDS, HAS_MAP, HAS_PASSES,
        )  # fmt: skip
        slot = tl.where(fits, slot, -1)
        if SPLIT:  # hits to out, misses to miss_out; the marks are cleared below, once all are read
            was_missed = tl.load(first_seen_ptr + key, mask=is_local, other=_EMPTY) == _MISSED
            tl.store(miss_out_ptr + positions, tl.where(was_missed, slot, -1).to(miss_out_ptr.dtype.element_ty),
                     mask=in_bounds)  # fmt: skip
            slot = tl.where(was_missed, -1, slot)
        else:
            tl.store(first_seen_ptr + key, _EMPTY, mask=is_local)
        tl.store(out_ptr + positions, slot.to(out_ptr.dtype.element_ty), mask=in_bounds)
    if SPLIT:
        tl.debug_barrier()
        for start in range(0, num_ids, BLOCK_IDS):
            _, _, _, key, is_local, _, _ = _block_of_call(
                start, ids_ptr, pass_ptr, pass_index, global_to_local_ptr, expert_to_slot_ptr, num_ids, num_global,
                key_offset, BLOCK_IDS, HAS_MAP, HAS_PASSES,
            )  # fmt: skip
            tl.store(first_seen_ptr + key, _EMPTY, mask=is_local)

    if fits:
        tl.store(plan_ptr, num_misses)
        tl.store(clock_ptr, base + num_unique.to(tl.int64))  # type: ignore[attr-defined]  # a tensor in the kernel
        calls = tl.where(pass_index == 0, 1, 0)
        add_counts(counters_ptr, layer, num_unique - num_misses, num_misses, num_evictions, calls, num_invalid, 0)
    else:
        tl.store(plan_ptr, 0)
        add_counts(counters_ptr, layer, 0, 0, 0, 0, num_invalid, 1)
