"""Slot bookkeeping: which key lives in which slot, and what one call must load or evict.

Pure Python, no tensors: the runtime slot pool and the trace simulator both admit calls
through `SlotTable.admit`, so they make identical decisions.

Semantics of one call (the contract every implementation of the cache follows):

* the call's keys are deduplicated, keeping the order of first appearance;
* keys are visited in that order; a resident key is a hit, any other a miss;
* a miss takes the lowest-numbered free slot, or else the slot of the victim the policy
  chooses among resident keys that this call does not use (so an expert loaded earlier in
  the call is never evicted by a later miss of the same call).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from expertcache.errors import CacheCapacityError
from expertcache.policies import EvictionPolicy, make_policy

Key = Hashable


@dataclass(frozen=True, slots=True)
class Admission:
    """What one call changed.

    Attributes:
        hits: resident keys the call used, in first-appearance order.
        loads: ``(key, slot)`` for every miss, in first-appearance order; the slot must be
            filled with the key's data before the call's kernels run.
        evictions: ``(key, slot)`` for every key that lost its slot, in eviction order.
    """

    hits: tuple[Key, ...]
    loads: tuple[tuple[Key, int], ...]
    evictions: tuple[tuple[Key, int], ...]


class SlotTable:
    """Maps keys to ``num_slots`` slots under an eviction policy.

    Invariants (checked by the tests after every call): ``slot_of`` and ``key_in`` are
    inverse on resident keys, at most ``num_slots`` keys are resident, and a slot never
    changes its number.
    """

    def __init__(self, num_slots: int, *, policy: str | EvictionPolicy = "lru") -> None:
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.num_slots = num_slots
        self.policy = make_policy(policy, capacity=num_slots)
        self._slot_of: dict[Key, int] = {}
        self._key_in: list[Key | None] = [None] * num_slots
        self._free: list[int] = list(range(num_slots))  # a heap: lowest free slot first

    def slot_of(self, key: Key) -> int:
        """The key's slot, or -1 when it is not resident."""
        return self._slot_of.get(key, -1)

    def key_in(self, slot: int) -> Key | None:
        """The key held by ``slot``, or None when the slot is free."""
        return self._key_in[slot]

    def resident(self) -> frozenset[Key]:
        """Every key that holds a slot."""
        return frozenset(self._slot_of)

    def check_capacity(self, num_keys: int, *, where: str = "") -> None:
        """Raise `CacheCapacityError` when ``num_keys`` distinct keys cannot fit at once."""
        if num_keys > self.num_slots:
            raise CacheCapacityError(num_keys, self.num_slots, where=where)

    def admit(self, keys: Iterable[Key]) -> Admission:
        """Make every key of one call resident and report what moved.

        Args:
            keys: the call's keys in use order; repeats are allowed and ignored.

        Raises:
            CacheCapacityError: more distinct keys than slots; nothing changes.
        """
        unique = list(dict.fromkeys(keys))
        self.check_capacity(len(unique))
        protected = set(unique)
        hits: list[Key] = []
        loads: list[tuple[Key, int]] = []
        evictions: list[tuple[Key, int]] = []
        self.policy.begin_call(unique)
        for key in unique:
            if key in self._slot_of:
                self.policy.on_hit(key)
                hits.append(key)
                continue
            slot = self._take_free_slot(protected, key, evictions)
            self._slot_of[key] = slot
            self._key_in[slot] = key
            self.policy.on_miss(key)
            loads.append((key, slot))
        self.policy.end_call()
        return Admission(tuple(hits), tuple(loads), tuple(evictions))

    def _take_free_slot(self, protected: set[Key], incoming: Key, evictions: list[tuple[Key, int]]) -> int:
        if self._free:
            return heapq.heappop(self._free)
        victim = self.policy.choose_victim(protected, incoming)
        if victim in protected or victim not in self._slot_of:
            raise RuntimeError(f"policy {self.policy.name!r} chose {victim!r}, which is not an evictable key")
        slot = self._slot_of.pop(victim)
        self._key_in[slot] = None
        self.policy.on_evict(victim)
        evictions.append((victim, slot))
        return slot
