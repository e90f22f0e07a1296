"""`TimedProvider`: a provider wrapper that records the host wall time of every ``prepare``
(and of every pass of ``passes``, which it forwards to the wrapped provider).

Part of the Prometheus metrics (`expertcache.metrics`): the counters are the provider's own
`CacheStats`, but nothing in a provider times its calls, so a provider wrapped in this one
also gets the ``expertcache_prepare_seconds`` histogram (`expertcache.metrics_collector`
reads `TimedProvider.prepare_seconds` at scrape time). Needs no ``prometheus_client``.
"""

from __future__ import annotations

import bisect
import math
import numbers
import time
from collections.abc import Generator, Iterable, Iterator
from typing import cast

import torch

from expertcache.provider import ExpertWeightProvider, PassResults
from expertcache.result import ExpertWeightResult
from expertcache.stats import CacheStats

#: Upper bounds (seconds) of the prepare-time histogram buckets.
PREPARE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


class TimedProvider(ExpertWeightProvider):
    """Wraps a provider and records the host wall time of every ``prepare``.

    Only wrap when metrics are wanted: the wrapper adds two clock reads per call. On a GPU
    the time is what the host spends in ``prepare`` (admission, the id read, launches);
    copies it enqueued may still be running when it returns.
    """

    def __init__(self, provider: ExpertWeightProvider, *, buckets: tuple[float, ...] = PREPARE_BUCKETS) -> None:
        if isinstance(provider, type) or not hasattr(provider, "prepare") or not hasattr(provider, "stats"):
            what = f"the class {provider.__name__}" if isinstance(provider, type) else type(provider).__name__
            raise TypeError(f"TimedProvider wraps a provider (an instance with prepare() and stats), got {what}")
        if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
            raise TypeError(f"buckets must be a sequence of seconds, got {type(buckets).__name__}")
        given = tuple(_seconds(bound) for bound in buckets)
        bounds = tuple(cast(float, bound) for bound in given)  # floats once the check below passes
        if not given or not all(_positive_finite(bound) for bound in given) or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"buckets must be increasing positive finite seconds, got {given!r:.80}")
        self.provider = provider
        self.buckets = bounds
        self._counts = [0] * (len(self.buckets) + 1)  # the last bucket is +Inf
        self._sum = 0.0

    @property
    def stats(self) -> CacheStats:
        """The wrapped provider's `CacheStats`."""
        return self.provider.stats  # type: ignore[attr-defined]

    def prepare(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        start = time.perf_counter()
        result = self.provider.prepare(topk_ids)
        self._observe(time.perf_counter() - start)
        return result

    def passes(
        self, topk_ids: torch.Tensor, *, overlap: bool = False, landing: bool = False
    ) -> Iterator[ExpertWeightResult]:
        """The wrapped provider's ``passes`` (its passes, overlap and landing as it serves
        them), each pass's host time recorded like a ``prepare``."""
        inner = self.provider.passes(topk_ids, overlap=overlap, landing=landing)  # checks ids and flags now
        timed = self._timed(inner)
        tensors = getattr(inner, "tensors", None)
        if tensors is None:
            return timed
        return PassResults(tensors, timed, topk_ids=inner.topk_ids, landing=inner.landing)  # type: ignore[attr-defined]

    def _timed(self, inner: Iterator[ExpertWeightResult]) -> Generator[ExpertWeightResult]:
        try:
            while True:
                start = time.perf_counter()
                try:
                    result = next(inner)
                except StopIteration:
                    return
                self._observe(time.perf_counter() - start)
                yield result
        finally:  # closed early: the wrapped call ends at once too
            close = getattr(inner, "close", None)
            if close is not None:
                close()

    def _observe(self, elapsed: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, elapsed)] += 1
        self._sum += elapsed

    def prepare_seconds(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative ``(upper bound, count)`` buckets (last ``"+Inf"``) and the sum."""
        cumulative, total = [], 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self._counts, strict=True):
            total += count
            cumulative.append((bound, total))
        return cumulative, self._sum


def _seconds(value: object) -> object:
    """A real number as a Python float (numpy's float32 too); anything else, a bool included,
    as it is, for `_positive_finite` to refuse."""
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value


def _positive_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
