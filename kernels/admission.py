"""Device-side LRU admission: one call's ids -> hits, misses, victims, copy plan, slot ids.

One single-program kernel per call, no host sync, fixed shapes (so it replays in a CUDA
graph). It makes exactly the decisions of the host `SlotTable` + `LRUPolicy`:

* keys deduplicated in first-appearance order of the row-major flattened ids;
* every key of the call is stamped ``base + ordinal`` (its first-appearance rank), so
  recency order = calls in order, then first appearance within a call;
* the r-th miss takes the r-th candidate slot in (last use, slot index) order, among slots
  that this call does not need; never-used slots carry last use -1, so free slots go
  first, lowest index first.

Phases, separated by CTA barriers::

    1 first_seen[key] = min position              (scatter-min over all ids)
    2 hits re-stamped; misses listed in order      (plan_expert[r], miss_stamp[r])
    3 r-th miss <- r-th coldest evictable slot     (victim tables updated, plan_slot[r])
    4 out[i] = expert_to_slot[key(i)]; first_seen reset for the next call

State tensors (all on the device, owned by `expertcache.device_table.DeviceSlotTable`)::

    expert_to_slot [num_keys] int32   slot of each key or -1
    slot_to_key    [S] int32          key in each slot or -1
    last_use       [S] int64          recency stamp, -1 = never used
    clock          [1] int64          next stamp base
    first_seen     [num_keys] int32   scratch, INT32_MAX between calls
    plan_expert    [S] int32          out: local expert (store row) of each miss
    plan_slot      [S] int32          out: destination slot of each miss
    miss_stamp     [S] int64          scratch
    plan_count     [1] int32          out: number of misses
    counters       [layers, 5] int64  hits, misses, evictions, calls, invalid ids
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import runs_on

FIRST_SEEN_EMPTY = 2**31 - 1
COUNTERS = ("hits", "misses", "evictions", "calls", "invalid_ids")
_KEY_MAX = tl.constexpr(2**63 - 1)  # Triton kernels read only constexpr globals


@triton.jit
def _keys_of(ids_ptr, global_to_local_ptr, positions, in_bounds, num_global, key_offset):
    ids = tl.load(ids_ptr + positions, mask=in_bounds, other=-1).to(tl.int32)
    valid_id = in_bounds & (ids >= 0) & (ids < num_global)
    invalid = in_bounds & ((ids < 0) | (ids >= num_global))
    local = tl.load(global_to_local_ptr + ids, mask=valid_id, other=-1)
    is_local = valid_id & (local >= 0)
    return local, local + key_offset, is_local, invalid


@triton.jit
def _admit_kernel(
    ids_ptr, global_to_local_ptr, out_ptr,
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, clock_ptr, first_seen_ptr,
    plan_expert_ptr, plan_slot_ptr, miss_stamp_ptr, plan_count_ptr, counters_ptr,
    num_ids, num_global, num_slots, key_offset, layer,
    BLOCK_IDS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, SLOT_BITS: tl.constexpr,
):  # fmt: skip
    base = tl.load(clock_ptr)

    # 1: first position of every key in the call
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        _, key, is_local, _ = _keys_of(ids_ptr, global_to_local_ptr, positions, in_bounds, num_global, key_offset)
        tl.atomic_min(first_seen_ptr + key, positions, mask=is_local)
    tl.debug_barrier()

    # 2: walk first appearances in order; stamp hits, list misses
    num_unique = 0
    num_misses = 0
    num_invalid = 0
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        local, key, is_local, invalid = _keys_of(
            ids_ptr, global_to_local_ptr, positions, in_bounds, num_global, key_offset
        )
        first = tl.load(first_seen_ptr + key, mask=is_local, other=-1)
        is_first = is_local & (first == positions)
        slot = tl.load(expert_to_slot_ptr + key, mask=is_first, other=-1)
        is_miss = is_first & (slot < 0)
        is_hit = is_first & (slot >= 0)
        ordinal = num_unique + tl.cumsum(is_first.to(tl.int32), axis=0) - 1
        miss_ordinal = num_misses + tl.cumsum(is_miss.to(tl.int32), axis=0) - 1
        stamp = base + ordinal.to(tl.int64)
        tl.store(last_use_ptr + slot, stamp, mask=is_hit)
        tl.store(plan_expert_ptr + miss_ordinal, local, mask=is_miss)
        tl.store(miss_stamp_ptr + miss_ordinal, stamp, mask=is_miss)
        num_unique += tl.sum(is_first.to(tl.int32), axis=0)
        num_misses += tl.sum(is_miss.to(tl.int32), axis=0)
        num_invalid += tl.sum(invalid.to(tl.int32), axis=0)
    tl.debug_barrier()

    # 3: victims, coldest first: key = (last_use + 1) << SLOT_BITS | slot, free slots at 0
    num_evictions = 0
    if num_misses > 0:
        slots = tl.arange(0, BLOCK_SLOTS)
        in_pool = slots < num_slots
        last = tl.load(last_use_ptr + slots, mask=in_pool, other=base)
        evictable = in_pool & (last < base)  # this call's keys are stamped >= base
        order = tl.where(evictable, ((last + 1) << SLOT_BITS) | slots.to(tl.int64), _KEY_MAX)
        for rank in range(0, num_misses):
            coldest = tl.min(order, axis=0)
            victim = (coldest & ((1 << SLOT_BITS) - 1)).to(tl.int32)
            order = tl.where(order == coldest, _KEY_MAX, order)
            old_key = tl.load(slot_to_key_ptr + victim)
            if old_key >= 0:
                tl.store(expert_to_slot_ptr + old_key, -1)
                num_evictions += 1
            local = tl.load(plan_expert_ptr + rank)
            tl.store(expert_to_slot_ptr + local + key_offset, victim)
            tl.store(slot_to_key_ptr + victim, local + key_offset)
            tl.store(last_use_ptr + victim, tl.load(miss_stamp_ptr + rank))
            tl.store(plan_slot_ptr + rank, victim)
    tl.debug_barrier()

    # 4: slot ids out; scratch back to empty
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        _, key, is_local, _ = _keys_of(ids_ptr, global_to_local_ptr, positions, in_bounds, num_global, key_offset)
        slot = tl.load(expert_to_slot_ptr + key, mask=is_local, other=-1)
        tl.store(out_ptr + positions, slot.to(out_ptr.dtype.element_ty), mask=in_bounds)
        tl.store(first_seen_ptr + key, 2147483647, mask=is_local)

    tl.store(plan_count_ptr, num_misses)
    tl.store(clock_ptr, base + num_unique.to(tl.int64))
    row = counters_ptr + layer * 5
    tl.store(row + 0, tl.load(row + 0) + (num_unique - num_misses).to(tl.int64))
    tl.store(row + 1, tl.load(row + 1) + num_misses.to(tl.int64))
    tl.store(row + 2, tl.load(row + 2) + num_evictions.to(tl.int64))
    tl.store(row + 3, tl.load(row + 3) + 1)
    tl.store(row + 4, tl.load(row + 4) + num_invalid.to(tl.int64))


@dataclass(frozen=True)
class AdmissionState:
    """The device tensors one admission reads and writes (see the module docstring)."""

    expert_to_slot: torch.Tensor
    slot_to_key: torch.Tensor
    last_use: torch.Tensor
    clock: torch.Tensor
    first_seen: torch.Tensor
    plan_expert: torch.Tensor
    plan_slot: torch.Tensor
    miss_stamp: torch.Tensor
    plan_count: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def empty(cls, num_keys: int, num_slots: int, num_layers: int, device: torch.device) -> AdmissionState:
        def full(size, value, dtype):
            return torch.full(size, value, dtype=dtype, device=device)

        return cls(
            expert_to_slot=full((num_keys,), -1, torch.int32),
            slot_to_key=full((num_slots,), -1, torch.int32),
            last_use=full((num_slots,), -1, torch.int64),
            clock=full((1,), 0, torch.int64),
            first_seen=full((num_keys,), FIRST_SEEN_EMPTY, torch.int32),
            plan_expert=full((num_slots,), -1, torch.int32),
            plan_slot=full((num_slots,), -1, torch.int32),
            miss_stamp=full((num_slots,), 0, torch.int64),
            plan_count=full((1,), 0, torch.int32),
            counters=full((num_layers, len(COUNTERS)), 0, torch.int64),
        )


def admit_on_device(
    state: AdmissionState,
    topk_ids: torch.Tensor,
    global_to_local: torch.Tensor,
    out: torch.Tensor,
    *,
    key_offset: int = 0,
    layer: int = 0,
) -> torch.Tensor:
    """Admit one call's experts and write slot ids to ``out``, all on the device.

    Args:
        state: the pool's device tables (updated in place).
        topk_ids: ``[T, K]`` int32/int64 global expert ids (contiguous).
        global_to_local: ``[E_global]`` int32, global id -> local expert or -1.
        out: ``[T, K]`` int32/int64, receives slot ids (-1: not local or invalid id).
        key_offset: first key of this layer in the pool's key space.
        layer: row of ``state.counters`` to count into.

    The caller guarantees at most ``num_slots`` distinct local experts per call (always
    true when ``T * K <= num_slots``). Ids outside ``[0, E_global)`` map to -1 and are
    counted as invalid.
    """
    if not runs_on(_admit_kernel, topk_ids):
        raise RuntimeError("device admission needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    num_slots = state.slot_to_key.numel()
    block_slots = max(16, triton.next_power_of_2(num_slots))
    num_ids = topk_ids.numel()
    block_ids = min(1024, max(16, triton.next_power_of_2(num_ids)))
    _admit_kernel[(1,)](
        topk_ids, global_to_local, out,
        state.expert_to_slot, state.slot_to_key, state.last_use, state.clock, state.first_seen,
        state.plan_expert, state.plan_slot, state.miss_stamp, state.plan_count, state.counters,
        num_ids, global_to_local.numel(), num_slots, key_offset, layer,
        BLOCK_IDS=block_ids, BLOCK_SLOTS=block_slots, SLOT_BITS=max(1, (block_slots - 1).bit_length()),
        num_warps=4 if block_slots <= 1024 else 8,
    )  # fmt: skip
    return out
