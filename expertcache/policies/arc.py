"""ARC (Megiddo and Modha, FAST 2003): adaptive balance of recency and frequency.

Resident keys seen once sit in ``T1``, keys seen at least twice in ``T2``; the ghost lists
``B1`` and ``B2`` remember keys recently evicted from each. A miss that hits a ghost list
moves the target size ``p`` of ``T1`` toward the list that would have kept the key, and
``REPLACE`` evicts from ``T1`` when it is over ``p``, else from ``T2``.

Mapping onto the policy interface: ``choose_victim`` runs ``REPLACE`` with the ``p`` the
incoming key's ghost hit would give (without changing anything); ``on_evict`` takes the
victim out of ``T1``/``T2``; ``on_miss`` then applies the adaptation and the directory
bookkeeping of the paper's cases II-IV with the list sizes as they were before the
eviction, so the lists evolve exactly as in the paper. The only departure: a key of the
current call is never evicted, so ``REPLACE`` falls back to the other list (or a later
key of the same list) when its first choice is protected.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from expertcache.policies.base import EvictionPolicy, Key


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache over ``OrderedDict`` lists (least recent first)."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target = 0.0  # the paper's p: target size of T1
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._pending: tuple[Key, bool] | None = None  # (victim, came from T1)

    def on_hit(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def choose_victim(self, protected: Container[Key], incoming: Key) -> Key:
        target = self._adapted_target(incoming)
        t1_size = len(self._t1)
        from_t1 = t1_size >= 1 and (t1_size > target or (incoming in self._b2 and t1_size == target))
        lists = (self._t1, self._t2) if from_t1 else (self._t2, self._t1)
        for keys in lists:
            for key in keys:
                if key not in protected:
                    return key
        raise LookupError("every resident key is protected by the current call")

    def on_evict(self, key: Key) -> None:
        from_t1 = key in self._t1
        del (self._t1 if from_t1 else self._t2)[key]
        self._pending = (key, from_t1)

    def on_miss(self, key: Key) -> None:
        pending, self._pending = self._pending, None
        if key in self._b1 or key in self._b2:
            self.target = self._adapted_target(key)
            (self._b1 if key in self._b1 else self._b2).pop(key)
            self._add_ghost(pending)
            self._t2[key] = None
        else:
            if pending is not None:
                self._new_key_directory(pending)
            self._t1[key] = None
        self._trim_directory()

    # -- the paper's bookkeeping -------------------------------------------------------------

    def _adapted_target(self, incoming: Key) -> float:
        b1, b2 = len(self._b1), len(self._b2)
        if incoming in self._b1:
            return min(float(self.capacity), self.target + max(b2 / b1, 1.0))
        if incoming in self._b2:
            return max(0.0, self.target - max(b1 / b2, 1.0))
        return self.target

    def _new_key_directory(self, pending: tuple[Key, bool]) -> None:
        # Case IV with a full cache, sizes as they were before the victim left T1/T2.
        t1_before = len(self._t1) + int(pending[1])
        t2_before = len(self._t2) + int(not pending[1])
        if t1_before + len(self._b1) >= self.capacity:
            if t1_before < self.capacity:
                self._b1.popitem(last=False)
                self._add_ghost(pending)
            # else: T1 alone filled the cache; its LRU key leaves without a ghost
            return
        total = t1_before + t2_before + len(self._b1) + len(self._b2)
        if total >= 2 * self.capacity and self._b2:
            self._b2.popitem(last=False)
        self._add_ghost(pending)

    def _add_ghost(self, pending: tuple[Key, bool] | None) -> None:
        if pending is not None:
            victim, from_t1 = pending
            (self._b1 if from_t1 else self._b2)[victim] = None

    def _trim_directory(self) -> None:
        # Keeps |T1| + |B1| <= c and the directory <= 2c when protection bent REPLACE.
        while len(self._t1) + len(self._b1) > self.capacity and self._b1:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * self.capacity:
            (self._b2 if self._b2 else self._b1).popitem(last=False)
