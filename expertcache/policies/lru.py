"""Least-recently-used eviction on an ``OrderedDict`` (first entry = least recent)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from expertcache.policies.base import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    """Evicts the resident key whose last use is oldest.

    Recency is the order of use: calls in order, and within a call keys in order of first
    appearance in the row-major flattened ``topk_ids``.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_hit(self, key: Key) -> None:
        self._order.move_to_end(key)

    def on_miss(self, key: Key) -> None:
        self._order[key] = None

    def on_evict(self, key: Key) -> None:
        del self._order[key]

    def choose_victim(self, protected: Container[Key], incoming: Key) -> Key:
        for key in self._order:
            if key not in protected:
                return key
        raise LookupError("every resident key is protected by the current call")
