"""LFRU: frequency over age, the score the vLLM expert-offload RFC proposes.

``score = uses / (1 + age)`` where ``uses`` counts every call that ever used the key (the
history survives eviction, so a returning hot expert is recognised) and ``age`` is the
number of calls since its last use. The lowest score is evicted: rarely used keys go
first, and a once-hot key fades as it ages instead of squatting forever as in LFU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from expertcache.policies.base import Key
from expertcache.policies.ranked import RankedPolicy


class LFRUPolicy(RankedPolicy):
    """Evicts the lowest ``uses / (1 + calls since last use)``; ties: least recent."""

    name = "lfru"
    columns = ("uses_total", "last_call")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._history: dict[Key, int] = {}

    def _on_use(self, key: Key, row: int, *, hit: bool) -> None:
        uses = self._history.get(key, 0) + 1
        self._history[key] = uses
        self._set("uses_total", row, uses)
        self._set("last_call", row, self.calls)

    def _rank(self, column: dict[str, np.ndarray]) -> Sequence[np.ndarray]:
        age = self.calls - column["last_call"]
        return column["last_use"], column["uses_total"] / (1.0 + age)
