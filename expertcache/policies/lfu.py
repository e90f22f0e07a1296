"""Least-frequently-used eviction: the resident key used by the fewest calls goes first."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from expertcache.policies.base import Key
from expertcache.policies.ranked import RankedPolicy


class LFUPolicy(RankedPolicy):
    """Evicts the resident key with the fewest uses since it was loaded; ties: least recent.

    Counts start at 1 on every load (an evicted key forgets its history, as in cachetools'
    ``LFUCache``), so a formerly hot expert has to earn its place again.
    """

    name = "lfu"
    columns = ("frequency",)

    def _on_use(self, key: Key, row: int, *, hit: bool) -> None:
        self._set("frequency", row, self._get("frequency", row) + 1 if hit else 1)

    def _rank(self, column: dict[str, np.ndarray]) -> Sequence[np.ndarray]:
        return column["last_use"], column["frequency"]
