"""`RankedPolicy`: policies whose victim is the lowest-ranked resident key.

LFU, LFRU, GDSF, Least-Stale and Belady each give every resident key a few numbers (a
frequency, a last use, a priority, a next use) and evict the key that sorts first. Those
numbers live in numpy columns, one row per resident key, so a victim costs one ``lexsort``
per call instead of a Python scan per eviction: within one call the order of the keys
that may still be evicted cannot change (ages are counted in calls, and every key the call
touches is protected), so the order is computed at the call's first eviction and walked
for the rest of the call. Only the head of the order is sorted (a call evicts at most one
key per distinct key it uses), so a large global pool pays ``O(n)``, not ``O(n log n)``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Container, Sequence
from typing import ClassVar

import numpy as np

from expertcache.policies.base import EvictionPolicy, Key


class RankedPolicy(EvictionPolicy):
    """Evicts the resident key that sorts first under `_rank`.

    Subclasses name their per-key ``columns`` (float64), fill them in `_on_admit` and
    `_on_use`, and return sort keys from `_rank`. The base keeps two clocks: ``calls`` (calls
    begun so far) and ``uses`` (hits and misses so far; within a call, first-appearance
    order), and the column ``last_use`` (the ``uses`` clock at the key's latest use).
    """

    #: Per-key columns besides ``last_use``.
    columns: ClassVar[tuple[str, ...]] = ()

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.calls = 0
        self.uses = 0
        self._keys: list[Key] = []
        self._row: dict[Key, int] = {}
        size = max(int(capacity), 1)
        self._data = {name: np.zeros(size) for name in ("last_use", *self.columns)}
        self._victim_order: np.ndarray | None = None
        self._victim_keys: list[Key] = []
        self._cursor = 0
        self._call_size = 0

    # -- subclass hooks ----------------------------------------------------------------------

    def _on_admit(self, key: Key, row: int) -> None:  # noqa: B027 - optional hook
        """``key`` just got ``row``; fill the subclass columns."""

    def _on_use(self, key: Key, row: int, *, hit: bool) -> None:  # noqa: B027 - optional hook
        """``key`` (at ``row``) is used by the current call, a hit or a fresh admission."""

    def _on_drop(self, key: Key, row: int) -> None:  # noqa: B027 - optional hook
        """``key`` (still at ``row``) is being evicted."""

    @abstractmethod
    def _rank(self, column: dict[str, np.ndarray]) -> Sequence[np.ndarray]:
        """Sort keys for ``np.lexsort`` over resident rows (the last one is the primary key).

        ``column[name]`` is the ``[n]`` float64 column of the ``n`` resident keys.
        """

    # -- EvictionPolicy ----------------------------------------------------------------------

    def begin_call(self, keys: Sequence[Key]) -> None:
        self.calls += 1
        self._call_size = len(keys)
        self._victim_order = None

    def end_call(self) -> None:
        self._victim_order = None

    def abort_call(self) -> None:
        self.calls -= 1
        self._victim_order = None

    def on_hit(self, key: Key) -> None:
        self._use(key, self._row[key], hit=True)

    def on_miss(self, key: Key) -> None:
        row = len(self._keys)
        if row == len(self._data["last_use"]):
            self._data = {name: np.resize(values, 2 * row) for name, values in self._data.items()}
        self._keys.append(key)
        self._row[key] = row
        self._on_admit(key, row)
        self._use(key, row, hit=False)

    def on_evict(self, key: Key) -> None:
        row = self._row.pop(key)
        self._on_drop(key, row)
        last = len(self._keys) - 1
        if row != last:  # move the last row into the hole
            moved = self._keys[last]
            self._keys[row] = moved
            self._row[moved] = row
            for values in self._data.values():
                values[row] = values[last]
        self._keys.pop()

    def choose_victim(self, protected: Container[Key], incoming: Key) -> Key:
        if self._victim_order is None:
            self._wanted = 2 * self._call_size + 1
            self._victim_order = self._order(self._wanted)
            self._victim_keys = list(self._keys)
            self._cursor = 0
        while True:
            # Keys passed over are protected by this call, already evicted in it, or of a
            # layer at its share (`expertcache.layer_shares`: a count only falls during a
            # call): all stay ineligible until the call ends, so the cursor never goes back.
            while self._cursor < len(self._victim_order):
                key = self._victim_keys[int(self._victim_order[self._cursor])]
                if key in self._row and key not in protected:
                    return key
                self._cursor += 1
            if len(self._victim_order) == len(self._victim_keys):
                raise LookupError("every resident key is protected by the current call")
            # The short list ran out (keys of layers at their share skipped): a longer one.
            # Every list is a prefix of the next, so the cursor stays where it is.
            self._wanted *= 4
            self._victim_order = self._order(self._wanted)

    def _order(self, wanted: int) -> np.ndarray:
        """Rows of resident keys in eviction order: the ``wanted`` first (with every tie of
        the last one), or all when that is as many.

        A call evicts at most one key per miss and skips at most its own keys, so the
        ``2 * call_size + 1`` lowest rows suffice for a pool of one layer (in a shared pool
        the keys of layers at their share are skipped too: `choose_victim` asks for more);
        ``np.partition`` finds them without sorting the whole cache. Each list is a prefix
        of the whole order.
        """
        count = len(self._keys)
        view = {name: values[:count] for name, values in self._data.items()}
        ranks = tuple(self._rank(view))
        if wanted >= count:
            return np.lexsort(ranks)
        primary = ranks[-1]
        threshold = np.partition(primary, wanted - 1)[wanted - 1]
        rows = np.flatnonzero(primary <= threshold)
        return rows[np.lexsort(tuple(rank[rows] for rank in ranks))]

    # -- helpers -----------------------------------------------------------------------------

    def _use(self, key: Key, row: int, *, hit: bool) -> None:
        self.uses += 1
        self._data["last_use"][row] = self.uses
        self._on_use(key, row, hit=hit)

    def _set(self, name: str, row: int, value: float) -> None:
        self._data[name][row] = value

    def _get(self, name: str, row: int) -> float:
        return float(self._data[name][row])
