"""Host mode's ``prepare``: any policy plans on the host, the device tables stay the truth.

One call, each step after the first able to fail without leaving a trace::

    read    ids and the committed state (tables, counters) to the host (one sync); range-check,
            map global -> local, deduplicate into keys; refuse more keys than the share
    plan    `call_plan.plan_call` on that snapshot: hits, loads, victims (the policy hears
            only that the call begins)
    move    the plan's copies (copy engine, or upload + copy kernel)        -+ rolled back
    commit  upload the plan, one kernel: tables updated, call counted,       | on any error
            ids remapped to slots                                            |
    tell    the policy hears of the call (`call_plan.tell_policy`)          -+

A call of more keys than the pool's share (its slots, for one layer) runs as expert-group
passes (`passes`, `expertcache.passes`), each of them such a call of its group's keys. Only
pass 0 reads: a later pass plans on the table as the passes before it left it (their plans
applied on the host), and snapshots the state for its rollback on the device, so the host
plans and enqueues pass g+1 while the GPU still runs pass g. Should any other call begin on
the pool between two passes (the generator yields), the next pass reads again.

``SIGINT`` is held from plan to tell (`call_guards.deferred_interrupts`); an exception
there restores the slots the plan overwrote (`mover.restore_slots`), the tables and
counters (from the bytes read in step one), and makes the policy forget the call
(``abort_call``), or, when one of its hooks raised in tell, puts it back as its
``snapshot()`` before plan left it.

This module owns that sequence: the read (the one sync), the steps in order, the passes
and the rollback. The keys a call's ids come to are `expertcache.host_keys`'; the host's
copy of the table the planner reads, `expertcache.host_table`; the forward-pass starts
the policy hears of, `expertcache.forward_tracker` (their public names importable from
here too).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from expertcache.call_guards import deferred_interrupts
from expertcache.call_plan import CallPlan, plan_call, tell_policy
from expertcache.errors import CacheCapacityError
from expertcache.forward_tracker import ForwardTracker
from expertcache.host_keys import DEVICE_KEYS_MIN_IDS, first_positions, keys_from_first_positions, local_keys
from expertcache.host_table import apply_plan, expert_to_slot, free_slots_in, key_row, slot_of_key
from expertcache.kernels._launch import on_device
from expertcache.kernels.commit import commit_plan
from expertcache.mover import copy_with_engine, copy_with_kernel, restore_slots
from expertcache.passes import group_passes

if TYPE_CHECKING:
    from expertcache.pool_layers import PoolLayer
    from expertcache.slot_pool import SlotPool

__all__ = [
    "DEVICE_KEYS_MIN_IDS",
    "ForwardTracker",
    "first_positions",
    "key_row",
    "keys_from_first_positions",
    "local_keys",
    "passes",
    "prepare",
]


def prepare(pool: SlotPool, layer: PoolLayer, topk_ids: torch.Tensor) -> torch.Tensor:
    """Host-mode ``SlotPool.prepare`` (see the module docstring)."""
    _check_not_compiling()
    with pool.guard, on_device(pool.device):
        keys, committed = _read_call(pool, layer, topk_ids)
        if len(keys) > pool.share:
            raise CacheCapacityError(len(keys), pool.share, layers=len(pool.layers))
        table = expert_to_slot(pool, committed)
        return _serve(pool, layer, topk_ids.contiguous(), keys, table, torch.from_numpy(committed))[0]


def passes(pool: SlotPool, layer: PoolLayer, topk_ids: torch.Tensor, overlap: bool = False) -> Generator[torch.Tensor]:
    """Host-mode ``SlotPool.passes``: slot ids of each expert-group pass (`expertcache.passes`;
    ``overlap`` groups as overlapped passes, so the decisions are device mode's).

    The groups come from the state read for pass 0; every pass is then an ordinary call of
    its group's keys (plan, move, commit, tell), so each one is atomic. Pass g > 0 plans on
    the table the earlier passes committed, known on the host from their plans, unless
    another call began on the pool in between (then it reads the state again).
    """
    _check_not_compiling()
    ids = topk_ids.contiguous()
    with pool.guard, on_device(pool.device):
        keys, committed = _read_call(pool, layer, ids)
        table = expert_to_slot(pool, committed)
        groups = group_passes(keys, [bool(table[key] >= 0) for key in keys], pool.share, overlap=overlap)
        if len(groups) == 1:
            only, _ = _serve(pool, layer, ids, keys, table, torch.from_numpy(committed))
    if len(groups) == 1:
        yield only
        return
    pass_of = _pass_of_ids(pool, layer, ids, groups)
    table, snapshot, begun = table.copy(), torch.from_numpy(committed), pool.calls_begun
    for index, group in enumerate(groups):
        with pool.guard, on_device(pool.device):
            if index > 0 and pool.calls_begun != begun:  # another call ran between the passes
                _, committed = _read(pool, None)
                table, snapshot = expert_to_slot(pool, committed).copy(), torch.from_numpy(committed)
            elif index > 0:  # the state the last pass committed, copied on the device (no sync)
                snapshot = pool.tables.committed.clone()
            out, plan = _serve(pool, layer, ids, list(group), table, snapshot, passes=(pass_of, index))
            begun = pool.calls_begun
            apply_plan(table, plan)
        yield out


def _serve(
    pool: SlotPool,
    layer: PoolLayer,
    ids: torch.Tensor,
    keys: list[int],
    table: np.ndarray,
    snapshot: torch.Tensor,
    passes: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, CallPlan]:
    """Plan, move, commit and tell one call (or pass) of ``keys``.

    Args:
        table: ``expert_to_slot`` now (int32, every key of the pool), the planner's view.
        snapshot: the committed state bytes now (host or device), restored on an error.
    """
    pool.calls_begun += 1
    out = torch.empty_like(ids)
    first_pass = passes is None or passes[1] == 0
    starts_forward = first_pass and pool.forward.starts_forward(layer.name)
    policy = pool.policy
    assert policy is not None  # a host-mode pool always has one
    with deferred_interrupts():
        before = policy.snapshot()
        plan = plan_call(
            keys, table[keys].tolist(), slot_of=lambda key: slot_of_key(table, key),
            free_slots=lambda: free_slots_in(table, pool.num_slots), policy=policy, starts_forward=starts_forward,
            floor=pool.floor(layer, table),
        )  # fmt: skip
        try:
            _upload(pool, layer, plan)
            _move(pool, layer, plan)
            _commit(pool, layer, plan, ids, out, passes)
        except BaseException:  # even a launch that raised after it ran leaves nothing behind
            _take_back(pool, plan, snapshot)
            policy.abort_call()
            raise
        try:
            tell_policy(plan, policy, before)
        except BaseException:  # a hook raised: the policy is as before, so are the slots and tables now
            _take_back(pool, plan, snapshot)
            raise
        if first_pass:
            pool.forward.record(layer.name)
    return out, plan


def _take_back(pool: SlotPool, plan: CallPlan, snapshot: torch.Tensor) -> None:
    """Undo a call's copies and commit: the slots its loads overwrote, then the state bytes."""
    restore_slots(pool.tensors, plan.loads, pool.store_of)
    pool.tables.committed.copy_(snapshot)


def _check_not_compiling() -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError("host mode reads ids on the host and cannot be compiled; use mode='device'")


def _read_call(pool: SlotPool, layer: PoolLayer, ids: torch.Tensor) -> tuple[list[int], np.ndarray]:
    """The call's distinct keys (first-appearance order, range-checked) and the committed
    state bytes, through the call's one sync."""
    if ids.numel() < DEVICE_KEYS_MIN_IDS:
        ids_host, committed = _read(pool, ids)
        return local_keys(layer, ids_host), committed
    summary, committed = _read(pool, first_positions(ids.reshape(-1), layer.num_global))
    return keys_from_first_positions(layer, summary, ids.numel()), committed


def _pass_of_ids(pool: SlotPool, layer: PoolLayer, ids: torch.Tensor, groups: list[tuple[int, ...]]) -> torch.Tensor:
    """``[T, K]`` int32 on the device: the pass of each id (0 for other ranks' ids), gathered
    on the device from a ``[E_global]`` table."""
    group_of = np.zeros(layer.key_offset + layer.num_experts, dtype=np.int32)
    for index, group in enumerate(groups):
        group_of[list(group)] = index
    local = layer.global_to_local_host
    by_global = np.where(local >= 0, group_of[np.maximum(local, 0) + layer.key_offset], 0).astype(np.int32)
    table = torch.from_numpy(by_global)
    if pool.device.type == "cuda":
        table = table.pin_memory()  # the caching host allocator keeps it alive until the copy ran
    return table.to(pool.device, non_blocking=True)[ids.long()]


def _read(pool: SlotPool, topk_ids: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """``topk_ids`` (when given) and the committed state (tables and counters, as bytes) on
    the host: the call's one sync. The state is what the planner reads and what a rollback
    restores."""
    committed = pool.tables.committed
    if pool.device.type != "cuda":
        return (np.empty(0) if topk_ids is None else topk_ids.numpy()), committed.numpy().copy()
    ids_host = None if topk_ids is None else topk_ids.to("cpu", non_blocking=True)
    committed_host = committed.to("cpu", non_blocking=True)
    torch.cuda.current_stream(pool.device).synchronize()
    return (np.empty(0) if ids_host is None else ids_host.numpy()), committed_host.numpy()


def _upload(pool: SlotPool, layer: PoolLayer, plan: CallPlan) -> None:
    """Write the plan's entries (expert, slot, key, evicted key) into the device plan."""
    if not plan.loads:
        return
    entries = [
        (cast(int, load.key) - layer.key_offset, load.slot, load.key, -1 if load.evicted is None else load.evicted)
        for load in plan.loads
    ]
    flat = torch.tensor([len(entries), *(value for entry in entries for value in entry)], dtype=torch.int32)
    target = pool.tables.plan[: flat.numel()]
    if pool.device.type == "cuda":
        flat = flat.pin_memory()  # the caching host allocator keeps it alive until the copy ran
    target.copy_(flat, non_blocking=True)


def _move(pool: SlotPool, layer: PoolLayer, plan: CallPlan) -> None:
    if not plan.loads:
        return
    if pool.mover == "engine":
        copy_with_engine(
            pool.tensors, layer.store, plan.loads, layer.key_offset, pool.copy_expert, pool.tables.plan,
            layer.copy_groups,
        )  # fmt: skip
        return
    copy_with_kernel(pool.tensors, layer.store, pool.tables.plan, layer.copy_groups)


def _commit(
    pool: SlotPool,
    layer: PoolLayer,
    plan: CallPlan,
    ids: torch.Tensor,
    out: torch.Tensor,
    passes: tuple[torch.Tensor, int] | None,
) -> None:
    pass_of, pass_index = passes if passes is not None else (None, 0)
    commit_plan(
        pool.tables, ids, layer.global_to_local, out,
        counts=(len(plan.hits), len(plan.loads), len(plan.evictions)), has_plan=bool(plan.loads),
        num_global=layer.num_global, key_offset=layer.key_offset, layer=layer.index,
        passes=pass_of, pass_index=pass_index,
    )  # fmt: skip
