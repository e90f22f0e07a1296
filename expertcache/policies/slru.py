"""Segmented LRU: a probation segment for new keys, a main segment for keys used twice.

A miss enters probation; a hit in probation promotes the key to the main segment, whose
least recent key drops back to probation when the segment is over its share (80% of the
capacity by default). Victims come from probation first, least recent first, so a burst of
one-off experts cannot flush the experts that keep coming back.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Container

from expertcache.policies.base import EvictionPolicy, Key


class SLRUPolicy(EvictionPolicy):
    """Two LRU segments (``OrderedDict``, least recent first): probation and main.

    Args:
        capacity: keys the cache holds.
        main_fraction: share of ``capacity`` the main segment may hold, in (0, 1].
    """

    name = "slru"

    def __init__(self, capacity: int, *, main_fraction: float = 0.8) -> None:
        super().__init__(capacity)
        if isinstance(main_fraction, bool) or not isinstance(main_fraction, numbers.Real):
            raise TypeError(f"main_fraction must be a number in (0, 1], got {type(main_fraction).__name__}")
        if not 0.0 < main_fraction <= 1.0:
            raise ValueError(f"main_fraction must be in (0, 1], got {main_fraction}")
        self.main_capacity: int = max(1, int(self.capacity * main_fraction))
        self._probation: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()

    def on_hit(self, key: Key) -> None:
        if key in self._main:
            self._main.move_to_end(key)
            return
        del self._probation[key]
        self._main[key] = None
        if len(self._main) > self.main_capacity:
            demoted, _ = self._main.popitem(last=False)
            self._probation[demoted] = None

    def on_miss(self, key: Key) -> None:
        self._probation[key] = None

    def on_evict(self, key: Key) -> None:
        if key in self._probation:
            del self._probation[key]
        else:
            del self._main[key]

    def choose_victim(self, protected: Container[Key], incoming: Key) -> Key:
        for segment in (self._probation, self._main):
            for key in segment:
                if key not in protected:
                    return key
        raise LookupError("every resident key is protected by the current call")
