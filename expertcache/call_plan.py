"""Deciding one call on the host: which keys hit, which load into which slot, which are evicted.

Pure Python, no tensors. Host mode (`expertcache.host_prepare`) and the trace simulator
(`expertcache.slot_table.SlotTable`) both decide through `plan_call`, so they make identical
decisions; device mode's LRU kernel makes the same ones for ``policy="lru"``.

Semantics of one call (the contract every implementation of the cache follows):

* the call's keys are deduplicated, keeping the order of first appearance;
* a resident key is a hit;
* the misses, in that order, take the free slots (lowest first), then the slots of victims
  that the policy chooses among resident keys this call does not use (so an expert loaded
  earlier in the call is never evicted by a later miss of the same call) and, in a pool
  shared by several layers, not of another layer holding no more than its share
  (`expertcache.layer_shares`); every choice is made on the state before the call;
* planning tells the policy only that the call begins (``begin_forward`` when it starts a
  forward pass, ``begin_call``); once the plan's work is done, `tell_policy` reports it in
  order (per key ``on_hit``, or ``on_evict(victim)`` if it took one then ``on_miss``;
  ``end_call``), and if the work fails, ``policy.abort_call()`` forgets the call; if a hook
  raises, `tell_policy` puts the policy back as the ``policy.snapshot()`` taken before
  ``plan_call`` left it, and the caller takes its work back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from expertcache.layer_shares import LayerFloor, Protected
from expertcache.policies import EvictionPolicy, Key


@dataclass(frozen=True, slots=True)
class Load:
    """One miss: ``key`` goes into ``slot``, which ``evicted`` held (None: the slot was free)."""

    key: Key
    slot: int
    evicted: Key | None


@dataclass(frozen=True, slots=True)
class CallPlan:
    """What one call does.

    Attributes:
        keys: the call's distinct keys in first-appearance order.
        hits: resident keys the call uses, in that order.
        loads: every miss, in that order; each slot must hold its key's data before the
            call's kernels run.
    """

    keys: tuple[Key, ...]
    hits: tuple[Key, ...]
    loads: tuple[Load, ...]

    @property
    def evictions(self) -> tuple[tuple[Key, int], ...]:
        """``(key, slot)`` of every key that loses its slot, in eviction order."""
        return tuple((load.evicted, load.slot) for load in self.loads if load.evicted is not None)


def plan_call(
    keys: Sequence[Key],
    slots: Sequence[int],
    *,
    slot_of: Callable[[Key], int],
    free_slots: Callable[[], Iterator[int]],
    policy: EvictionPolicy,
    starts_forward: bool = False,
    floor: LayerFloor | None = None,
) -> CallPlan:
    """Plan one call; the policy hears only that it begins (see the module docstring).

    Args:
        keys: the call's distinct keys, in first-appearance order (at most the slots).
        slots: the current slot of each key, -1 when it is not resident.
        slot_of: the current slot of any key (victims), -1 when not resident.
        free_slots: an iterator over the free slots, lowest first (asked for only on a miss).
        policy: chooses victims (`EvictionPolicy.choose_victim` must not change it).
        starts_forward: the call is the first of a forward pass (``begin_forward``).
        floor: in a pool shared by several layers, the other layers' shares (None: one layer).

    Raises:
        RuntimeError: the policy chose a key that is not resident, or one the call uses;
            the policy has then forgotten the call (``abort_call``).
    """
    if starts_forward:
        policy.begin_forward()
    policy.begin_call(tuple(keys))
    try:
        return _plan(keys, slots, slot_of, free_slots, policy, Protected(set(keys), floor))
    except BaseException:
        policy.abort_call()
        raise


def _plan(keys, slots, slot_of, free_slots, policy, excluded: Protected) -> CallPlan:
    hits: list[Key] = []
    loads: list[Load] = []
    free: Iterator[int] | None = None
    for key, slot in zip(keys, slots, strict=True):
        if slot >= 0:
            hits.append(key)
            continue
        if free is None:
            free = free_slots()
        target = next(free, None)
        if target is not None:
            loads.append(Load(key, target, None))
            continue
        victim = policy.choose_victim(excluded, key)
        victim_slot = -1 if victim in excluded else slot_of(victim)
        if victim_slot < 0:
            raise RuntimeError(f"policy {policy.name!r} chose {victim!r}, which is not an evictable key")
        excluded.add(victim)
        loads.append(Load(key, victim_slot, victim))
    return CallPlan(tuple(keys), tuple(hits), tuple(loads))


def tell_policy(plan: CallPlan, policy: EvictionPolicy, before: object) -> None:
    """Report a planned call whose work is done to the policy (the module docstring's order).

    Args:
        before: ``policy.snapshot()`` taken before `plan_call`: if a hook raises, the
            policy is restored to it and the error propagates (the caller then takes its
            work back).
    """
    loads = {load.key: load for load in plan.loads}
    try:
        for key in plan.keys:
            load = loads.get(key)
            if load is None:
                policy.on_hit(key)
                continue
            if load.evicted is not None:
                policy.on_evict(load.evicted)
            policy.on_miss(key)
        policy.end_call()
    except BaseException:
        policy.restore(before)
        raise
