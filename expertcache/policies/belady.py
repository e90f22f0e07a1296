"""Belady's MIN: evict the key whose next use is farthest in the future (simulation only).

Clairvoyant: before the first call it must be told every call (`set_future`), which only a
simulator replaying a trace can do. A call served in expert-group passes
(`expertcache.passes`) arrives as several calls, each a part of the future call. With
every key of a call required at once and one slot per key, farthest-next-use is the
optimal demand policy, so its hit count bounds every other policy's on the same calls
(the simulator's tests check this on random streams of calls that fit).
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
        self._started = 0  # future calls begun
        self._left: set[Key] = set()  # keys of the current future call no pass has begun

    def set_future(self, calls: Sequence[Sequence[Key]]) -> None:
        self._future = [frozenset(call) for call in calls]
        self._uses_of = {}
        for index, call in enumerate(self._future):
            for key in call:
                self._uses_of.setdefault(key, []).append(index)
        self._next_index = dict.fromkeys(self._uses_of, 0)
        self._started, self._left = 0, set()

    def begin_call(self, keys: Sequence[Key]) -> None:
        if self._future is None:
            raise RuntimeError(
                "belady is clairvoyant: simulation only (expertcache.sim.replay tells it the "
                "future); a runtime cache cannot use it"
            )
        if not self._left:  # the next future call begins (whole, or with its first pass)
            index = self._started
            if index >= len(self._future) or not frozenset(keys) <= self._future[index]:
                raise RuntimeError(f"call {index} differs from the future given to belady")
            self._left = set(self._future[index])
            self._started += 1
        elif not self._left.issuperset(keys):
            raise RuntimeError(f"a pass of call {self._started - 1} differs from the future given to belady")
        self._left.difference_update(keys)
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
