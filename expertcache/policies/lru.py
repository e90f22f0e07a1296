"""Least-recently-used eviction on an ``OrderedDict`` (first entry = least recent)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence

from expertcache.policies.base import EvictionPolicy, Key

_NONE = object()  # no victim given yet in this search (None may be a key)


class LRUPolicy(EvictionPolicy):
    """Evicts the resident key whose last use is oldest.

    Recency is the order of use: calls in order, and within a call keys in order of first
    appearance in the row-major flattened ``topk_ids``.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()
        # Where the victim search of the current call stopped: keys passed over stay protected
        # until the call ends (`EvictionPolicy.choose_victim`), so the next miss goes on from
        # there. Any change to the order ends it.
        self._scan: Iterator[Key] | None = None
        self._found: object = _NONE  # the last victim it gave

    def begin_call(self, keys: Sequence[Key]) -> None:
        self._scan = None

    def end_call(self) -> None:
        self._scan = None  # between calls no search is open (a snapshot copies no iterator)

    def abort_call(self) -> None:
        self._scan = None

    def on_hit(self, key: Key) -> None:
        self._scan = None
        self._order.move_to_end(key)

    def on_miss(self, key: Key) -> None:
        self._scan = None
        self._order[key] = None

    def on_evict(self, key: Key) -> None:
        self._scan = None
        del self._order[key]

    def choose_victim(self, protected: Container[Key], incoming: Key) -> Key:
        if self._scan is None:
            self._scan, self._found = iter(self._order), _NONE
        if self._found is not _NONE and self._found not in protected:
            return self._found  # asked again: the same answer
        for key in self._scan:
            if key not in protected:
                self._found = key
                return key
        raise LookupError("every resident key is protected by the current call")
