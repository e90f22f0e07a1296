"""Host-mode commit: apply a plan the host wrote to the tables, count the call, remap its ids.

In host mode a policy decides on the host and writes the plan (`expertcache.planner`); once
the plan's copies are enqueued, this one launch makes the decisions true on the device::

    for every plan entry r:  expert_to_slot[evicted[r]] = -1
                             expert_to_slot[key[r]] = slot[r];  slot_to_key[slot[r]] = key[r]
    counters[layer] += (hits, misses, evictions, 1 call)
    out = slot ids of topk_ids                                   (the shared `lookup_slots`)

An expert-group pass (`expertcache.passes`) commits like a call; only its positions get
slot ids and only pass 0 counts as a call.

A call without misses skips the plan (``HAS_PLAN=False``): the launch only counts and remaps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import runs_on
from expertcache.kernels.passes import in_pass
from expertcache.kernels.remap import lookup_slots
from expertcache.kernels.slot_tables import SlotTables, add_counts


# The counts change every call: specialising on them (== 1, multiples of 16) would compile
# new variants mid-run.
@triton.jit(do_not_specialize=["hits", "misses", "evictions", "calls", "pass_index"])
def _commit_kernel(
    plan_ptr, expert_to_slot_ptr, slot_to_key_ptr, counters_ptr, ids_ptr, global_to_local_ptr, out_ptr, pass_ptr,
    num_ids, num_global, num_keys, num_slots, key_offset, layer, hits, misses, evictions, calls, pass_index,
    BLOCK_SLOTS: tl.constexpr, BLOCK_IDS: tl.constexpr, HAS_MAP: tl.constexpr, HAS_PLAN: tl.constexpr,
    HAS_PASSES: tl.constexpr,
):  # fmt: skip
    if HAS_PLAN:
        count = tl.minimum(tl.load(plan_ptr), num_slots)
        rank = tl.arange(0, BLOCK_SLOTS)
        listed = rank < count
        slot = tl.load(plan_ptr + 2 + 4 * rank, mask=listed, other=-1)
        key = tl.load(plan_ptr + 3 + 4 * rank, mask=listed, other=-1)
        evicted = tl.load(plan_ptr + 4 + 4 * rank, mask=listed, other=-1)
        ok = listed & (slot >= 0) & (slot < num_slots) & (key >= 0) & (key < num_keys)
        tl.store(expert_to_slot_ptr + evicted, -1, mask=ok & (evicted >= 0) & (evicted < num_keys))
        tl.debug_barrier()
        tl.store(expert_to_slot_ptr + key, slot, mask=ok)
        tl.store(slot_to_key_ptr + slot, key, mask=ok)
        tl.debug_barrier()
    add_counts(counters_ptr, layer, hits, misses, evictions, calls, 0, 0)
    for start in range(0, num_ids, BLOCK_IDS):
        positions = start + tl.arange(0, BLOCK_IDS)
        in_bounds = positions < num_ids
        in_call = in_pass(pass_ptr, positions, in_bounds, pass_index, HAS_PASSES)
        _, _, _, _, found = lookup_slots(
            ids_ptr, positions, in_call, global_to_local_ptr, expert_to_slot_ptr, num_global, key_offset, HAS_MAP
        )
        tl.store(out_ptr + positions, found.to(out_ptr.dtype.element_ty), mask=in_bounds)


def commit_plan(
    tables: SlotTables,
    topk_ids: torch.Tensor,
    global_to_local: torch.Tensor | None,
    out: torch.Tensor,
    *,
    counts: tuple[int, int, int],
    has_plan: bool,
    num_global: int,
    key_offset: int,
    layer: int,
    passes: torch.Tensor | None = None,
    pass_index: int = 0,
) -> None:
    """Apply ``tables.plan`` (when ``has_plan``), count, and write slot ids into ``out``.

    Args:
        tables: the pool's state; ``tables.plan`` holds the host's plan when ``has_plan``.
        topk_ids: ``[T, K]`` int32/int64 global ids, contiguous (already range-checked).
        global_to_local: ``[E_global]`` int32 map, or None for the identity.
        out: ``[T, K]`` contiguous, receives slot ids (-1: another rank's expert).
        counts: ``(hits, misses, evictions)`` of the call.
        has_plan: whether the call has misses (``tables.plan`` was uploaded).
        num_global, key_offset, layer, passes, pass_index: as in
            `expertcache.kernels.admission.admit` (positions of other passes come out -1).

    On a CPU tensor without ``TRITON_INTERPRET=1`` the torch reference runs instead.
    """
    if not runs_on(topk_ids):
        commit_plan_torch(
            tables, topk_ids, global_to_local, out, counts=counts, has_plan=has_plan,
            num_global=num_global, key_offset=key_offset, layer=layer, passes=passes, pass_index=pass_index,
        )  # fmt: skip
        return
    hits, misses, evictions = counts
    mapping = global_to_local if global_to_local is not None else topk_ids
    _commit_kernel[(1,)](
        tables.plan, tables.expert_to_slot, tables.slot_to_key, tables.counters, topk_ids, mapping, out,
        passes if passes is not None else out, topk_ids.numel(), num_global, tables.num_keys, tables.num_slots,
        key_offset, layer, hits, misses, evictions, int(pass_index == 0), pass_index,
        BLOCK_SLOTS=max(16, triton.next_power_of_2(tables.num_slots)),
        BLOCK_IDS=min(1024, max(16, triton.next_power_of_2(topk_ids.numel()))),
        HAS_MAP=global_to_local is not None, HAS_PLAN=has_plan, HAS_PASSES=passes is not None, num_warps=4,
    )  # fmt: skip


def commit_plan_torch(
    tables: SlotTables,
    topk_ids: torch.Tensor,
    global_to_local: torch.Tensor | None,
    out: torch.Tensor,
    *,
    counts: tuple[int, int, int],
    has_plan: bool,
    num_global: int,
    key_offset: int,
    layer: int,
    passes: torch.Tensor | None = None,
    pass_index: int = 0,
) -> None:
    """Reference of `commit_plan` in torch indexing."""
    if has_plan:
        count = int(tables.plan[0])
        entries = tables.plan_entries()[:count].long()
        slots, keys, evicted = entries[:, 1], entries[:, 2], entries[:, 3]
        tables.expert_to_slot[evicted[evicted >= 0]] = -1
        tables.expert_to_slot[keys] = slots.to(torch.int32)
        tables.slot_to_key[slots] = keys.to(torch.int32)
    hits, misses, evictions = counts
    calls = int(pass_index == 0)
    tables.counters[layer] += torch.tensor([hits, misses, evictions, calls, 0, 0], device=tables.counters.device)
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < num_global)
    if passes is not None:
        valid &= passes == pass_index
    safe = torch.where(valid, ids, 0)
    local = safe if global_to_local is None else global_to_local.long()[safe]
    is_local = valid & (local >= 0)
    slots_out = tables.expert_to_slot.long()[torch.where(is_local, local + key_offset, 0)]
    out.copy_(torch.where(is_local, slots_out, -1))
