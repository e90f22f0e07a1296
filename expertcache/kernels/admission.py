"""Device-mode LRU admission: one call's ids -> hits, misses, victims, the copy plan, slot ids.

No host sync, fixed shapes (so it replays in a CUDA graph). It makes exactly the decisions
of the host planner (`expertcache.planner`) with the LRU policy:

* keys deduplicated in first-appearance order of the row-major flattened ids;
* every key of the call is stamped ``base + ordinal`` (its first-appearance rank), so
  recency order = calls in order, then first appearance within a call;
* the r-th miss takes the r-th candidate slot in (last use, slot index) order, among slots
  that this call does not need; never-used slots carry last use -1, so free slots go
  first, lowest index first; in a pool of several layers (``key_layer``) a slot of another
  layer holding no more than its share is no candidate (`expertcache.layer_shares`).

It updates the tables (`expertcache.kernels.slot_tables`), writes the plan that the copy
kernel executes, and the slot ids (through the shared `lookup_slots`). A call with more
distinct local experts than slots changes nothing: its ids come out -1, the plan is empty
and the layer's ``overflows`` counter counts it (the host-visible path raises instead).
Given a pass tensor (`expertcache.kernels.passes`), the call is one expert-group pass:
only the positions of that pass, each group at most ``S`` keys, so it always fits.

Two kernels, one contract (`expertcache.kernels.admission_kernels`): a register kernel for
calls of at most ``SMALL_CALL`` ids (decode), a scatter-min one for any size (prefill).
This module launches them (`admit`) and holds their pure-torch reference (`admit_torch`).
"""

from __future__ import annotations

import torch
import triton

from expertcache.kernels._launch import chains_launches, runs_on, walk_launch
from expertcache.kernels.admission_kernels import _admit_kernel, _admit_small_kernel
from expertcache.kernels.landing import check_landed
from expertcache.kernels.slot_tables import SlotTables

#: Largest call (T * K ids) served by the register kernel.
SMALL_CALL = 64


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
    key_layer: torch.Tensor | None = None,
    num_warps: int | None = None,
    block_ids: int | None = None,
    landed: torch.Tensor | None = None,
    landed_target: int = 0,
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
            computed while the misses are copied.
        key_layer: ``[num_keys]`` int32, the layer of every key, for a pool of several layers:
            misses then respect the other layers' shares (``tables.share``); None: one layer.
        num_warps: of the launch, a power of two up to 32 (default: 4 for the small-call kernel;
            `expertcache.kernels._launch.walk_launch`'s for the large-call one, at least 8 over
            more than 1,024 slots).
        block_ids: ids the large-call kernel reads a step, a power of two from 16 to 65,536
            (default: `walk_launch`'s); the small-call kernel holds the whole call.
        landed: optional ``[S]`` int32 landing counters of this call (`expertcache.kernels.landing`):
            zeroed, then ``landed_target`` written at every hit's slot; the copy kernel counts
            the misses' slots up to it.
        landed_target: chunks one expert takes over the layer's copy groups (positive).
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
    common["HAS_SHARES"] = key_layer is not None
    if key_layer is not None and (
        key_layer.dtype != torch.int32 or key_layer.shape != (tables.num_keys,) or key_layer.device != topk_ids.device
    ):
        raise ValueError(f"key_layer must be an int32 tensor of num_keys={tables.num_keys} layers on the ids' device")
    layers = key_layer if key_layer is not None else tables.slot_to_key  # any int32 pointer when unused
    pass_of = passes if passes is not None else out
    state = (tables.expert_to_slot, tables.slot_to_key, tables.last_use, tables.clock)
    if miss_out is not None and (
        not miss_out.is_contiguous() or miss_out.shape != out.shape or miss_out.dtype != out.dtype
    ):
        raise ValueError("miss_out must be a contiguous tensor like out")
    common["SPLIT"] = miss_out is not None
    miss_out = out if miss_out is None else miss_out  # any pointer of out's type when unused
    if landed is not None:
        check_landed(landed, num_slots, topk_ids.device, landed_target)
    common["HAS_LANDED"] = landed is not None
    landed_arg = landed if landed is not None else tables.slot_to_key  # any int32 pointer when unused
    block, warps = walk_launch(num_ids, block_ids, num_warps, min_warps=8 if block_slots > 1024 else 4)  # checks both
    if num_ids <= SMALL_CALL:
        _admit_small_kernel[(1,)](
            topk_ids, mapping, out, miss_out, *state, tables.plan, tables.miss_stamp, tables.counters, layers,
            pass_of, landed_arg, num_ids, num_global, num_slots, key_offset, layer, tables.share, pass_index,
            landed_target, BLOCK_IDS=max(16, triton.next_power_of_2(num_ids)), num_warps=num_warps or 4, **common,
        )  # fmt: skip
    else:
        _admit_kernel[(1,)](
            topk_ids, mapping, out, miss_out, *state, tables.first_seen, tables.plan, tables.miss_stamp,
            tables.counters, layers, pass_of, landed_arg, num_ids, num_global, num_slots, key_offset, layer,
            tables.share, pass_index, landed_target,
            BLOCK_IDS=block, num_warps=warps, **common,
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
    key_layer: torch.Tensor | None = None,
    landed: torch.Tensor | None = None,
    landed_target: int = 0,
) -> None:
    """Reference of `admit`, one key at a time in Python (same tables, plan, counters and
    landing counters)."""
    if landed is not None:
        landed.zero_()
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
            if landed is not None:
                landed[slot] = landed_target
        else:
            misses.append((key, base + ordinal))
    order = sorted((int(last[s]), s) for s in range(tables.num_slots) if int(last[s]) < base)
    victims = _victims(order, len(misses), s2k.tolist(), None if key_layer is None else key_layer.tolist(),
                       layer, tables.share)  # fmt: skip
    entries = tables.plan_entries()
    evictions = 0
    for rank, ((key, stamp), victim) in enumerate(zip(misses, victims, strict=False)):
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


def _victims(
    order: list[tuple[int, int]],
    count: int,
    slot_to_key: list[int],
    key_layer: list[int] | None,
    layer: int,
    share: int,
) -> list[int]:
    """The first ``count`` slots of ``order`` (coldest first) that a miss of ``layer`` may
    take: a slot of another layer holding no more than ``share`` only once no other is left."""
    owner = [-1 if key < 0 or key_layer is None else key_layer[key] for key in slot_to_key]
    held = [owner.count(index) for index in range(max(owner, default=-1) + 1)]
    left, chosen = [slot for _, slot in order], list[int]()
    while len(chosen) < count and left:
        allowed = [s for s in left if owner[s] in (-1, layer) or held[owner[s]] > share]
        victim = (allowed or left)[0]
        left.remove(victim)
        if owner[victim] >= 0:
            held[owner[victim]] -= 1
        chosen.append(victim)
    return chosen
