"""Least-Stale: evict experts the current forward pass has already used first.

In a pool shared by all layers, a forward pass visits layers in order, so an expert that
this pass already used cannot be needed again until the same layer comes round in the next
pass, while an expert not yet used in this pass may be needed by a layer still to come.
Among the used ("stale") ones the most recently used goes first: under the layer cycle it
is the one whose layer comes round last. Keys the pass has not used are evicted least
recently used first. A per-layer pool sees one call per pass, whose keys are all
protected, so there Least-Stale is exactly LRU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from expertcache.policies.base import Key
from expertcache.policies.ranked import RankedPolicy


class LeastStalePolicy(RankedPolicy):
    """Evicts keys used in the current forward pass first (most recent first), then LRU.

    Forward passes are delimited by `begin_forward`; a cache that never calls it treats
    every call as its own pass.
    """

    name = "least_stale"
    columns = ("last_forward",)

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.forwards = 0
        self._explicit_forwards = False
        self._before_call: tuple[int, bool] | None = None  # restored by abort_call

    def begin_forward(self) -> None:
        self._remember()
        self._explicit_forwards = True
        self.forwards += 1

    def begin_call(self, keys: Sequence[Key]) -> None:
        self._remember()
        super().begin_call(keys)
        if not self._explicit_forwards:
            self.forwards += 1

    def end_call(self) -> None:
        super().end_call()
        self._before_call = None

    def abort_call(self) -> None:
        super().abort_call()
        if self._before_call is not None:
            self.forwards, self._explicit_forwards = self._before_call
        self._before_call = None

    def _remember(self) -> None:
        if self._before_call is None:
            self._before_call = (self.forwards, self._explicit_forwards)

    def _on_use(self, key: Key, row: int, *, hit: bool) -> None:
        self._set("last_forward", row, self.forwards)

    def _rank(self, column: dict[str, np.ndarray]) -> Sequence[np.ndarray]:
        # one key without ties: stale keys negative (most recent first), the rest positive
        # (least recent first); last_use is at least 1
        stale = column["last_forward"] == self.forwards
        return (np.where(stale, -column["last_use"], column["last_use"]),)
