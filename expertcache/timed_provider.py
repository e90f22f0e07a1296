"""`TimedProvider`: a provider wrapper that records the host wall time of every ``prepare``.

Part of the Prometheus metrics (`expertcache.metrics`): the counters are the provider's own
`CacheStats`, but nothing in a provider times its calls, so a provider wrapped in this one
also gets the ``expertcache_prepare_seconds`` histogram (`expertcache.metrics_collector`
reads `TimedProvider.prepare_seconds` at scrape time). Needs no ``prometheus_client``.
"""

from __future__ import annotations

import bisect
import math
import time

import torch

from expertcache.provider import ExpertWeightProvider
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
        if not hasattr(provider, "prepare") or not hasattr(provider, "stats"):
            raise TypeError(f"TimedProvider wraps a provider with prepare() and stats, got {type(provider).__name__}")
        bounds = tuple(buckets)
        if not bounds or not all(_positive_finite(bound) for bound in bounds) or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"buckets must be increasing positive finite seconds, got {bounds!r:.80}")
        self.provider = provider
        self.buckets = tuple(float(bound) for bound in bounds)
        self._counts = [0] * (len(self.buckets) + 1)  # the last bucket is +Inf
        self._sum = 0.0

    @property
    def stats(self) -> CacheStats:
        """The wrapped provider's `CacheStats`."""
        return self.provider.stats  # type: ignore[attr-defined]

    def prepare(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        start = time.perf_counter()
        result = self.provider.prepare(topk_ids)
        elapsed = time.perf_counter() - start
        self._counts[bisect.bisect_left(self.buckets, elapsed)] += 1
        self._sum += elapsed
        return result

    def prepare_seconds(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative ``(upper bound, count)`` buckets (last ``"+Inf"``) and the sum."""
        cumulative, total = [], 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self._counts, strict=True):
            total += count
            cumulative.append((bound, total))
        return cumulative, self._sum


def _positive_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
