"""`TimedProvider`: a provider wrapper that records the host wall time of every ``prepare``
(and of every pass of ``passes``, which it forwards to the wrapped provider).

Part of the Prometheus metrics (`expertcache.metrics`): the counters are the provider's own
`CacheStats`, but nothing in a provider times its calls, so a provider wrapped in this one
also gets the ``expertcache_prepare_seconds`` histogram (`expertcache.metrics_collector`
reads `TimedProvider.prepare_seconds` at scrape time). Needs no ``prometheus_client``.

A scrape runs on another thread than the calls it reads: a lock makes each recording (a
bucket and the sum) and each read one step, so a scrape never sees a sum that disagrees with
the buckets or the count. It is held for a few list and float operations, never across the
wrapped call.
"""

from __future__ import annotations

import bisect
import math
import numbers
import threading
import time
from collections.abc import Generator, Iterable, Iterator

import numpy as np
import torch

from expertcache.provider import ExpertWeightProvider, PassResults
from expertcache.result import ExpertWeightResult
from expertcache.stats import CacheStats

#: What the wrapper answers as its provider does (and only where the provider has it), so a
#: `DecodeStack` prefetches into, and checks the router width of, a timed cache as a bare one.
FORWARDED = (
    "mode", "num_experts", "num_global_experts", "prefetch", "check_prefetch", "finish_prefetch", "prefetch_stats",
)  # fmt: skip

#: Upper bounds (seconds) of the prepare-time histogram buckets.
PREPARE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


class TimedProvider(ExpertWeightProvider):
    """Wraps a provider and records the host wall time of every ``prepare``.

    Only wrap when metrics are wanted: the wrapper adds two clock reads per call. On a GPU
    the time is what the host spends in ``prepare`` (admission, the id read, launches);
    copies it enqueued may still be running when it returns.

    Args:
        provider: the provider to time: an instance with ``prepare`` and ``stats`` (a
            `CachedWeightProvider`), not its class.
        buckets: the histogram's upper bounds in seconds, increasing, positive and finite:
            any real numbers (numpy floats too; a float32 bound is read as the shortest
            decimal naming it, so ``np.float32(0.001)`` is the bucket ``le="0.001"``).
            Leave it out for `PREPARE_BUCKETS`; None is refused, not read as the default.

    Raises:
        TypeError: ``provider`` is a class or lacks ``prepare``/``stats``; ``buckets`` is
            not a sequence of real numbers. ValueError: the bounds are empty, not
            increasing, not positive or not finite.
    """

    def __init__(self, provider: ExpertWeightProvider, *, buckets: Iterable[float] = PREPARE_BUCKETS) -> None:
        if isinstance(provider, type) or not hasattr(provider, "prepare") or not hasattr(provider, "stats"):
            what = f"the class {provider.__name__}" if isinstance(provider, type) else type(provider).__name__
            raise TypeError(
                f"TimedProvider wraps a provider: an instance with prepare() and stats (e.g. "
                f"CachedWeightProvider(weights, cache_size=...)), got {what}"
            )
        self.buckets = _check_buckets(buckets)
        self.provider = provider
        self._counts = [0] * (len(self.buckets) + 1)  # the last bucket is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()  # a bucket and the sum change, and are read, together

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        """`FORWARDED` attributes of the wrapped provider (prefetches are not timed)."""
        if name in FORWARDED and "provider" in self.__dict__:
            return getattr(self.provider, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
        bucket = bisect.bisect_left(self.buckets, elapsed)
        with self._lock:
            self._counts[bucket] += 1
            self._sum += elapsed

    def prepare_seconds(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative ``(upper bound, count)`` buckets (last ``"+Inf"``) and the sum, read at
        one moment (safe from any thread: the sum always matches the buckets)."""
        with self._lock:
            counts, seconds = list(self._counts), self._sum
        cumulative, total = [], 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), counts, strict=True):
            total += count
            cumulative.append((bound, total))
        return cumulative, seconds


def _check_buckets(buckets: object) -> tuple[float, ...]:
    """``buckets`` as Python floats, after checking they are increasing positive finite seconds."""
    expected = "a sequence of seconds (real numbers; leave it out for PREPARE_BUCKETS)"
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
        raise TypeError(f"buckets must be {expected}, got {type(buckets).__name__} {buckets!r:.40}")
    try:
        items = tuple(buckets)
    except TypeError as error:  # a 0-d array says it is iterable, then refuses
        raise TypeError(f"buckets must be {expected}, got {type(buckets).__name__} ({error})") from None
    bounds = tuple(_seconds(bound, expected) for bound in items)
    if (
        not bounds
        or not all(math.isfinite(bound) and bound > 0 for bound in bounds)
        or list(bounds) != sorted(set(bounds))
    ):
        raise ValueError(f"buckets must be increasing positive finite seconds, got {bounds!r:.80}")
    return bounds


def _seconds(bound: object, expected: str) -> float:
    if isinstance(bound, (bool, np.bool_)) or not isinstance(bound, numbers.Real):
        raise TypeError(f"buckets must be {expected}, got an item {type(bound).__name__} {bound!r:.40}")
    if isinstance(bound, np.floating):  # the decimal that was written, not float32's binary error
        return float(str(bound))
    return float(bound)
