"""Where a device-mode admission's misses go: the r-th listed miss takes the r-th coldest
evictable slot (the last step of both kernels in `expertcache.kernels.admission_kernels`).

* ``_place_misses``: picks each listed miss's victim, evicts the key it held, points the
  miss's key at it, stamps its last use and writes victim and evicted key into the plan. In
  a pool of several layers a slot of another layer at or below its share is not evictable
  (`expertcache.layer_shares`): one miss at a time, the search repeats past such a layer.
* ``_place_in_order``: every miss at once, where no layer's share guards a slot.
"""

from __future__ import annotations

import triton
import triton.language as tl

_KEY_MAX = tl.constexpr(2**63 - 1)  # Triton kernels read only constexpr globals
_MARK = tl.constexpr(2**62)  # above every (last use + 1, slot) pair: a guarded layer's slots sort last


@triton.jit
def _place_misses(
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_ptr, miss_stamp_ptr, key_layer_ptr,
    base, num_misses, num_slots, layer, share,
    BLOCK_SLOTS: tl.constexpr, SLOT_BITS: tl.constexpr, HAS_SHARES: tl.constexpr,
):  # fmt: skip
    """The r-th listed miss takes the r-th coldest evictable slot; returns evictions.

    Without ``HAS_SHARES`` the slots are sorted once and every miss placed at once
    (`_place_in_order`). With ``HAS_SHARES`` (a pool of several layers) a slot of another
    layer that holds no more than ``share`` slots is not evictable
    (`expertcache.layer_shares`): one miss at a time, the coldest slot is taken unless it
    is such a slot; then its whole layer is marked (sorted after every unmarked slot; a
    layer's count only falls during a call, so the mark stays right) and the search repeats.
    """
    slots = tl.arange(0, BLOCK_SLOTS)
    in_pool = slots < num_slots
    last = tl.load(last_use_ptr + slots, mask=in_pool, other=base)
    evictable = in_pool & (last < base)  # this call's keys are stamped >= base
    # (last use + 1, slot) packed in one int64: free slots (last use -1) sort first
    order = tl.where(evictable, ((last + 1) << SLOT_BITS) | slots.to(tl.int64), _KEY_MAX)
    if HAS_SHARES:
        held_key = tl.load(slot_to_key_ptr + slots, mask=in_pool, other=-1)
        owner = tl.load(key_layer_ptr + held_key, mask=held_key >= 0, other=-1)  # -1 = free
        num_evictions = 0
        for rank in range(0, num_misses):
            coldest = tl.min(order, axis=0)
            victim = (coldest & ((1 << SLOT_BITS) - 1)).to(tl.int32)
            victim_layer = tl.sum(tl.where(slots == victim, owner, 0), axis=0)
            held = tl.sum((owner == victim_layer).to(tl.int32), axis=0)
            guarded = (victim_layer >= 0) & (victim_layer != layer) & (held <= share) & (coldest < _MARK)
            while guarded:
                order = tl.where((owner == victim_layer) & (order != _KEY_MAX), order | _MARK, order)
                coldest = tl.min(order, axis=0)
                victim = (coldest & ((1 << SLOT_BITS) - 1)).to(tl.int32)
                victim_layer = tl.sum(tl.where(slots == victim, owner, 0), axis=0)
                held = tl.sum((owner == victim_layer).to(tl.int32), axis=0)
                guarded = (victim_layer >= 0) & (victim_layer != layer) & (held <= share) & (coldest < _MARK)
            owner = tl.where(slots == victim, layer, owner)
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
    else:  # every miss at once: the r-th smallest key is the r-th miss's victim
        num_evictions = _place_in_order(
            expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_ptr, miss_stamp_ptr, tl.sort(order, 0), slots,
            num_misses, SLOT_BITS,
        )  # fmt: skip
    return num_evictions


@triton.jit
def _place_in_order(
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_ptr, miss_stamp_ptr, ascending, ranks, num_misses,
    SLOT_BITS: tl.constexpr,
):  # fmt: skip
    """Miss r takes the slot of ``ascending[r]`` (the packed keys, sorted), all misses at
    once; returns evictions. The victims are distinct and hold no key of this call, so no
    two misses write one address."""
    listed = ranks < num_misses
    victim = (ascending & ((1 << SLOT_BITS) - 1)).to(tl.int32)
    old_key = tl.load(slot_to_key_ptr + victim, mask=listed, other=-1)
    key = tl.load(plan_ptr + 3 + 4 * ranks, mask=listed, other=-1)
    stamp = tl.load(miss_stamp_ptr + ranks, mask=listed, other=0)
    tl.store(expert_to_slot_ptr + old_key, tl.full(old_key.shape, -1, tl.int32), mask=listed & (old_key >= 0))
    tl.store(expert_to_slot_ptr + key, victim, mask=listed)
    tl.store(slot_to_key_ptr + victim, key, mask=listed)
    tl.store(last_use_ptr + victim, stamp, mask=listed)
    tl.store(plan_ptr + 2 + 4 * ranks, victim, mask=listed)
    tl.store(plan_ptr + 4 + 4 * ranks, old_key, mask=listed)
    return tl.sum((listed & (old_key >= 0)).to(tl.int32), axis=0)
