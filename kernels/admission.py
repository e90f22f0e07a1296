"""Device-side LRU admission: one call's ids -> hits, misses, victims, copy plan, slot ids.

No host sync, fixed shapes (so it replays in a CUDA graph). It makes exactly the decisions
of the host `SlotTable` + `LRUPolicy`:

* keys deduplicated in first-appearance order of the row-major flattened ids;
* every key of the call is stamped ``base + ordinal`` (its first-appearance rank), so
  recency order = calls in order, then first appearance within a call;
* the r-th miss takes the r-th candidate slot in (last use, slot index) order, among slots
  that this call does not need; never-used slots carry last use -1, so free slots go
  first, lowest index first.

Two kernels, one contract, each followed by the copy kernel (`copy_records`):

* ``_admit_small_kernel`` (calls of at most ``SMALL_CALL`` ids: decode) deduplicates in
  registers; a hit costs two dependent loads (ids, expert -> slot).
* ``_admit_kernel`` (any size: prefill) deduplicates through a scatter-min table.

Copying inside the admission launch (programs 1..P waiting on a flag that program 0 sets)
was measured and dropped: 4.97 us per call against 2.74 us for admission plus a separate
copy launch, in a CUDA graph on an H200 (benchmarks/README.md).

State tensors (all on the device)::

    expert_to_slot [num_keys] int32   slot of each key or -1
    slot_to_key    [S] int32          key in each slot or -1
    last_use       [S] int64          recency stamp, -1 = never used
    clock          [1] int64          next stamp base
    first_seen     [num_keys] int32   scratch of the large kernel, INT32_MAX between calls
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
from expertcache.kernels.copy_records import DEFAULT_BLOCK, DEFAULT_PROGRAMS, copy_planned_records

FIRST_SEEN_EMPTY = 2**31 - 1
COUNTERS = ("hits", "misses", "evictions", "calls", "invalid_ids")
#: Largest call (T * K ids) served by the register kernel.
SMALL_CALL = 64
_KEY_MAX = tl.constexpr(2**63 - 1)  # Triton kernels read only constexpr globals


@triton.jit
def _keys_of(ids_ptr, global_to_local_ptr, positions, in_bounds, num_global, key_offset, HAS_MAP: tl.constexpr):
    ids = tl.load(ids_ptr + positions, mask=in_bounds, other=-1).to(tl.int32)
    valid_id = in_bounds & (ids >= 0) & (ids < num_global)
    invalid = in_bounds & ((ids < 0) | (ids >= num_global))
    if HAS_MAP:
        local = tl.load(global_to_local_ptr + ids, mask=valid_id, other=-1)
    else:
        local = tl.where(valid_id, ids, -1)
    is_local = valid_id & (local >= 0)
    return local, local + key_offset, is_local, invalid


@triton.jit
def _place_misses(
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_expert_ptr, plan_slot_ptr, miss_stamp_ptr,
    base, num_misses, num_slots, key_offset, BLOCK_SLOTS: tl.constexpr, SLOT_BITS: tl.constexpr,
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
        local = tl.load(plan_expert_ptr + rank)
        tl.store(expert_to_slot_ptr + local + key_offset, victim)
        tl.store(slot_to_key_ptr + victim, local + key_offset)
        tl.store(last_use_ptr + victim, tl.load(miss_stamp_ptr + rank))
        tl.store(plan_slot_ptr + rank, victim)
    return num_evictions


@triton.jit
def _count(counters_ptr, layer, hits, misses, evictions, invalid):
    # one vector atomic, not five scalar read-modify-writes on the critical path
    lanes = tl.arange(0, 8)
    values = tl.where(lanes == 0, hits, tl.where(lanes == 1, misses, tl.where(lanes == 2, evictions, invalid)))
    values = tl.where(lanes == 3, 1, values)
    tl.atomic_add(counters_ptr + layer * 5 + lanes, values.to(tl.int64), mask=lanes < 5)


@triton.jit
def _admit_small_kernel(
    ids_ptr, global_to_local_ptr, out_ptr,
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, clock_ptr,
    plan_expert_ptr, plan_slot_ptr, miss_stamp_ptr, plan_count_ptr, counters_ptr,
    num_ids, num_global, num_slots, key_offset, layer,
    BLOCK_IDS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, SLOT_BITS: tl.constexpr, HAS_MAP: tl.constexpr,
):  # fmt: skip
    base = tl.load(clock_ptr)
    positions = tl.arange(0, BLOCK_IDS)
    in_bounds = positions < num_ids
    local, key, is_local, invalid = _keys_of(
        ids_ptr, global_to_local_ptr, positions, in_bounds, num_global, key_offset, HAS_MAP
    )
    slot = tl.load(expert_to_slot_ptr + key, mask=is_local, other=-1)
    same = (key[:, None] == key[None, :]) & is_local[:, None] & is_local[None, :]
    earlier = same & (positions[None, :] < positions[:, None])
    is_first = is_local & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    is_miss = is_first & (slot < 0)
    ordinal = tl.cumsum(is_first.to(tl.int32), axis=0) - 1
    miss_ordinal = tl.cumsum(is_miss.to(tl.int32), axis=0) - 1
    num_unique = tl.sum(is_first.to(tl.int32), axis=0)
    num_misses = tl.sum(is_miss.to(tl.int32), axis=0)
    stamp = base + ordinal.to(tl.int64)
    tl.store(last_use_ptr + slot, stamp, mask=is_first & (slot >= 0))
    tl.store(plan_expert_ptr + miss_ordinal, local, mask=is_miss)
    tl.store(miss_stamp_ptr + miss_ordinal, stamp, mask=is_miss)
    num_evictions = 0
    if num_misses > 0:
        tl.debug_barrier()
        num_evictions = _place_misses(
            expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_expert_ptr, plan_slot_ptr, miss_stamp_ptr,
            base, num_misses, num_slots, key_offset, BLOCK_SLOTS, SLOT_BITS,
        )  # fmt: skip
        tl.debug_barrier()
        # every position of a missed key (first or repeat) takes its first's slot
        missed = same & is_miss[None, :]
        rank = tl.sum(tl.where(missed, miss_ordinal[None, :], 0), axis=1)
        was_missed = tl.sum(missed.to(tl.int32), axis=1) > 0
        slot = tl.where(was_missed, tl.load(plan_slot_ptr + rank, mask=was_missed, other=-1), slot)
    tl.store(out_ptr + positions, tl.where(is_local, slot, -1).to(out_ptr.dtype.element_ty), mask=in_bounds)
    tl.store(plan_count_ptr, num_misses)
    tl.store(clock_ptr, base + num_unique.to(tl.int64))
    num_invalid = tl.sum(invalid.to(tl.int32), axis=0)
    _count(counters_ptr, layer, num_unique - num_misses, num_misses, num_evictions, num_invalid)


@triton.jit
def _admit_kernel(
    ids_ptr, global_to_local_ptr, out_ptr,
    expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, clock_ptr, first_seen_ptr,
    plan_expert_ptr, plan_slot_ptr, miss_stamp_ptr, plan_count_ptr, counters_ptr,
    num_ids, num_global, num_slots, key_offset, layer,
    BLOCK_IDS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, SLOT_BITS: tl.constexpr, HAS_MAP: tl.constexpr,
):  # fmt: skip
    base = tl.load(clock_ptr)
    # 1: first position of every key in the call
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        _, key, is_local, _ = _keys_of(
            ids_ptr, global_to_local_ptr, positions, in_bounds, num_global, key_offset, HAS_MAP
        )
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
            ids_ptr, global_to_local_ptr, positions, in_bounds, num_global, key_offset, HAS_MAP
        )
        first = tl.load(first_seen_ptr + key, mask=is_local, other=-1)
        is_first = is_local & (first == positions)
        slot = tl.load(expert_to_slot_ptr + key, mask=is_first, other=-1)
        is_miss = is_first & (slot < 0)
        ordinal = num_unique + tl.cumsum(is_first.to(tl.int32), axis=0) - 1
        miss_ordinal = num_misses + tl.cumsum(is_miss.to(tl.int32), axis=0) - 1
        stamp = base + ordinal.to(tl.int64)
        tl.store(last_use_ptr + slot, stamp, mask=is_first & (slot >= 0))
        tl.store(plan_expert_ptr + miss_ordinal, local, mask=is_miss)
        tl.store(miss_stamp_ptr + miss_ordinal, stamp, mask=is_miss)
        num_unique += tl.sum(is_first.to(tl.int32), axis=0)
        num_misses += tl.sum(is_miss.to(tl.int32), axis=0)
        num_invalid += tl.sum(invalid.to(tl.int32), axis=0)
    tl.debug_barrier()

    # 3: victims, coldest first
    num_evictions = 0
    if num_misses > 0:
        num_evictions = _place_misses(
            expert_to_slot_ptr, slot_to_key_ptr, last_use_ptr, plan_expert_ptr, plan_slot_ptr, miss_stamp_ptr,
            base, num_misses, num_slots, key_offset, BLOCK_SLOTS, SLOT_BITS,
        )  # fmt: skip
    tl.debug_barrier()

    # 4: slot ids out; scratch back to empty
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        _, key, is_local, _ = _keys_of(
            ids_ptr, global_to_local_ptr, positions, in_bounds, num_global, key_offset, HAS_MAP
        )
        slot = tl.load(expert_to_slot_ptr + key, mask=is_local, other=-1)
        tl.store(out_ptr + positions, slot.to(out_ptr.dtype.element_ty), mask=in_bounds)
        tl.store(first_seen_ptr + key, 2147483647, mask=is_local)

    tl.store(plan_count_ptr, num_misses)
    tl.store(clock_ptr, base + num_unique.to(tl.int64))
    _count(counters_ptr, layer, num_unique - num_misses, num_misses, num_evictions, num_invalid)


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


def admit_and_copy(
    state: AdmissionState,
    topk_ids: torch.Tensor,
    global_to_local: torch.Tensor | None,
    out: torch.Tensor,
    source: torch.Tensor,
    slots: torch.Tensor,
    *,
    num_global: int,
    key_offset: int = 0,
    layer: int = 0,
    copy_programs: int = DEFAULT_PROGRAMS,
    copy_block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Admit one call's experts, copy the misses into their slots, write slot ids to ``out``.

    Args:
        state: the pool's device tables (updated in place).
        topk_ids: ``[T, K]`` int32/int64 global expert ids (contiguous).
        global_to_local: ``[E_global]`` int32, global id -> local expert or -1; None when the
            map is the identity (no expert parallelism), which saves a dependent load.
        out: ``[T, K]`` int32/int64, receives slot ids (-1: not local or invalid id).
        num_global: number of global expert ids ``E_global`` (valid ids are ``[0, E_global)``).
        source: ``[E_local, R]`` uint8 records of this layer (pinned on a CUDA machine).
        slots: ``[S, R]`` uint8 slot records.
        key_offset: first key of this layer in the pool's key space.
        layer: row of ``state.counters`` to count into.
        copy_programs, copy_block: copy grid and chunk size (32-bit words).

    The caller guarantees at most ``num_slots`` distinct local experts per call (always
    true when ``T * K <= num_slots``). Ids outside ``[0, E_global)`` map to -1 and are
    counted as invalid.
    """
    if not runs_on(_admit_kernel, topk_ids):
        raise RuntimeError("device admission needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    num_slots = state.slot_to_key.numel()
    block_slots = max(16, triton.next_power_of_2(num_slots))
    num_ids = topk_ids.numel()
    has_map = global_to_local is not None
    mapping = global_to_local if has_map else topk_ids
    common = dict(BLOCK_SLOTS=block_slots, SLOT_BITS=max(1, (block_slots - 1).bit_length()), HAS_MAP=has_map)
    if num_ids <= SMALL_CALL:
        _admit_small_kernel[(1,)](
            topk_ids, mapping, out,
            state.expert_to_slot, state.slot_to_key, state.last_use, state.clock,
            state.plan_expert, state.plan_slot, state.miss_stamp, state.plan_count, state.counters,
            num_ids, num_global, num_slots, key_offset, layer,
            BLOCK_IDS=max(16, triton.next_power_of_2(num_ids)), num_warps=4, **common,
        )  # fmt: skip
    else:
        _admit_kernel[(1,)](
            topk_ids, mapping, out,
            state.expert_to_slot, state.slot_to_key, state.last_use, state.clock, state.first_seen,
            state.plan_expert, state.plan_slot, state.miss_stamp, state.plan_count, state.counters,
            num_ids, num_global, num_slots, key_offset, layer,
            BLOCK_IDS=min(1024, triton.next_power_of_2(num_ids)), num_warps=4 if block_slots <= 1024 else 8, **common,
        )  # fmt: skip
    copy_planned_records(
        source, slots, state.plan_expert, state.plan_slot, state.plan_count,
        num_programs=copy_programs, block=copy_block,
    )  # fmt: skip
    return out
