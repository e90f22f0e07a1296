"""GDSF (Greedy-Dual-Size-Frequency): keep keys that are used often and cost much to reload.

Every resident key has a priority ``H = clock + frequency * cost / size``; the lowest ``H``
is evicted and the clock rises to it, so keys not touched for long sink below newcomers
(aging without a timer). In a slot pool every key takes one slot (``size`` = 1): the
size-aware part is ``cost``, the bytes a miss copies, which lets a pool whose experts
differ in bytes (layers of different formats, or experts with and without extra tensors)
prefer to keep the expensive ones. With a uniform cost GDSF is LFU with dynamic aging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from expertcache.policies.base import Key
from expertcache.policies.ranked import RankedPolicy


class GDSFPolicy(RankedPolicy):
    """Evicts the lowest ``clock + frequency * cost(key)``; ties: least recent.

    Args:
        capacity: keys the cache holds.
        cost: ``cost(key) -> float``, the price of one miss of ``key`` (for example its
            record bytes); default 1 for every key.
    """

    name = "gdsf"
    columns = ("frequency", "priority")

    def __init__(self, capacity: int, *, cost: Callable[[Key], float] | None = None) -> None:
        super().__init__(capacity)
        if cost is not None and not callable(cost):
            raise TypeError(f"cost must be a function of a key (or None for 1 each), got {type(cost).__name__}")
        self.cost = cost if cost is not None else _unit_cost
        self.clock = 0.0

    def _on_use(self, key: Key, row: int, *, hit: bool) -> None:
        frequency = self._get("frequency", row) + 1 if hit else 1
        self._set("frequency", row, frequency)
        self._set("priority", row, self.clock + frequency * float(self.cost(key)))

    def _on_drop(self, key: Key, row: int) -> None:
        self.clock = max(self.clock, self._get("priority", row))

    def _rank(self, column: dict[str, np.ndarray]) -> Sequence[np.ndarray]:
        return column["last_use"], column["priority"]


def _unit_cost(key: Key) -> float:
    return 1.0
