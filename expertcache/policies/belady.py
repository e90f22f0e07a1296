"""Belady's MIN: evict the key whose next use is farthest in the future (simulation only).

Clairvoyant: before the first call it must be told every call (`set_future`), which only a
simulator replaying a trace can do. With every key of a call required at once and one slot
per key, farthest-next-use is the optimal demand policy, so its hit count bounds every
other policy's on the same calls (the simulator's tests check this on random streams).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from expertcache.policies.base import Key
from expertcache.policies.ranked import RankedPolicy

_NEVER = np.inf


class BeladyPolicy(RankedPolicy):
    """Evicts the resident key used again last (never again: first); ties: least recent.

    Raises:
        RuntimeError: a call arrives before `set_future`, or differs from the future given.
    """

    name = "belady"
    clairvoyant = True
    columns = ("next_use",)

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._future: list[frozenset[Key]] | None = None
        self._uses_of: dict[Key, list[int]] = {}
        self._next_index: dict[Key, int] = {}

    def set_future(self, calls: Sequence[Sequence[Key]]) -> None:
        self._future = [frozenset(call) for call in calls]
        self._uses_of = {}
        for index, call in enumerate(self._future):
            for key in call:
                self._uses_of.setdefault(key, []).append(index)
        self._next_index = dict.fromkeys(self._uses_of, 0)

    def begin_call(self, keys: Sequence[Key]) -> None:
        if self._future is None:
            raise RuntimeError(
                "belady is clairvoyant: simulation only (expertcache.sim.replay tells it the "
                "future); a runtime cache cannot use it"
            )
        index = self.calls
        if index >= len(self._future) or self._future[index] != frozenset(keys):
            raise RuntimeError(f"call {index} differs from the future given to belady")
        super().begin_call(keys)
        for key in keys:
            self._next_index[key] += 1  # the current use is consumed

    def _next_use(self, key: Key) -> float:
        uses = self._uses_of.get(key, ())
        position = self._next_index.get(key, 0)
        return float(uses[position]) if position < len(uses) else _NEVER

    def _on_use(self, key: Key, row: int, *, hit: bool) -> None:
        self._set("next_use", row, self._next_use(key))

    def _rank(self, column: dict[str, np.ndarray]) -> Sequence[np.ndarray]:
        return column["last_use"], -column["next_use"]
