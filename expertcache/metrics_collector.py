"""`CacheCollector`: the Prometheus collector that reads tracked providers' ``stats`` per scrape.

Part of the Prometheus metrics (`expertcache.metrics`, which serves a collector over HTTP).
Nothing is counted in the hot path: on every scrape the collector reads each tracked
provider's `CacheStats` (or the values frozen by `CacheCollector.paused`, around CUDA graph
capture) and yields one counter family per field in `_COUNTERS`, labelled by layer, plus
the prepare-time histogram of providers wrapped in `expertcache.timed_provider.TimedProvider`.
A provider whose ``stats`` raises (or stops being a `CacheStats` of non-negative integer
counts) during a scrape is left out of that scrape, logged and counted in
``<namespace>_stats_read_errors``; the other layers are served as ever. The collector holds
every tracked provider: `CacheCollector.untrack` one before dropping it (a disabled model's),
or its slots and host store stay allocated and its last counts stay exported.
"""

from __future__ import annotations

import logging
import numbers
import operator
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from expertcache.stats import CacheStats, checked_counts
from expertcache.timed_provider import TimedProvider

_LOG = logging.getLogger(__name__)

_COUNTERS = (
    ("hits", "hits", "Distinct experts of a call already resident, summed over calls."),
    ("misses", "misses", "Distinct experts of a call copied in, summed over calls."),
    ("evictions", "evictions", "Resident experts dropped to make room."),
    ("bytes_copied", "bytes_h2d", "Bytes calls copied from the host store into GPU slots (prefetches apart)."),
    (
        "compressed_bytes_copied",
        "compressed_bytes_h2d",
        "Bytes those copies read from the host store as stored: the coded bytes of a compressed store "
        "(compression='exponent'), bytes_copied otherwise.",
    ),
    ("prepare_calls", "calls", "prepare() calls that completed."),
    (
        "invalid_ids",
        "invalid_ids",
        "Expert ids outside [0, E) that device mode mapped to -1 (skipped) instead of raising; "
        "always 0 in host mode, which raises.",
    ),
    (
        "overflows",
        "overflows",
        "Device-mode calls refused on the device because they needed more distinct experts than slots "
        "(nothing changed, their ids came out -1); the paths that read ids on the host raise instead.",
    ),
)

_Timing = tuple[list[tuple[str, int]], float]  # `TimedProvider.prepare_seconds`: buckets, sum


class HasStats(Protocol):
    """Anything with a `CacheStats` snapshot: a provider, a wrapper, a model's layers."""

    @property
    def stats(self) -> CacheStats: ...


class CacheCollector(Collector):
    """Reads tracked providers' ``stats`` on every scrape.

    Args:
        providers: ``{layer label: provider}``; more can be added with `track`.
        namespace: metric name prefix.
    """

    def __init__(self, providers: Mapping[str, HasStats] | None = None, *, namespace: str = "expertcache") -> None:
        if not isinstance(namespace, str) or not _METRIC_NAME.fullmatch(namespace):
            raise ValueError(
                f"namespace must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got {namespace!r}"
            )
        self.namespace = namespace
        self._providers: dict[str, HasStats] = {}
        self._frozen: tuple[dict[str, CacheStats], dict[str, _Timing]] | None = None
        self._pause_depth = 0
        self._read_errors: dict[str, int] = {}  # per layer: scrapes its stats failed
        self._lock = threading.Lock()  # a read in flight ends before paused() returns
        self._add_checked(self.check_new(providers))

    def check_new(self, providers: Mapping[str, HasStats] | None) -> dict[str, HasStats]:
        """``providers`` keyed by label, after checking `track` would take every one.

        Raises:
            TypeError: not a mapping, a label neither a str nor an int, or a provider whose
                ``stats`` is missing or not a `CacheStats`. ValueError: an empty label, one
                already tracked, or two that read the same as strings.
        """
        if providers is None:
            return {}
        if not isinstance(providers, Mapping):
            raise TypeError(f"providers must be a mapping {{layer label: provider}}, got {type(providers).__name__}")
        checked: dict[str, HasStats] = {}
        for layer, provider in providers.items():
            label = self._check_label(layer, provider)
            if label in checked:
                raise ValueError(f"two providers are labelled layer {label!r}")
            checked[label] = provider
        return checked

    def track(self, layer: str, provider: HasStats) -> None:
        """Expose ``provider`` (anything whose ``stats`` is a `CacheStats`: a `CachedWeightProvider`,
        a `TimedProvider`; for a transformers model, each ``handle.provider(name)``) under
        ``layer`` (a non-empty str, or an int). The collector holds ``provider`` until `untrack`.

        Reads ``provider.stats`` once, to check it (a device-mode cache's counters: one
        device-to-host copy; not while a CUDA graph is captured).

        Raises:
            TypeError: ``provider``'s ``stats`` is missing, not a `CacheStats`, or holds a
                counter that is not an integer (every later scrape would leave it out).
                ValueError: a negative counter, or ``layer`` empty or already tracked.
        """
        self._add_checked({self._check_label(layer, provider): provider})

    def untrack(self, layer: str) -> None:
        """Stop exposing the provider tracked under ``layer`` (a str, or an int as in `track`)
        and drop the collector's reference to it: a provider that is dropped (a disabled
        model's, ``handle.disable()``) is freed, its slots and host store with it, only once
        no collector tracks it. Its series end at the next scrape (a paused collector serves
        the values frozen on entry until it resumes).

        Raises:
            TypeError: ``layer`` neither a str nor an int. KeyError: ``layer`` not tracked.
        """
        label = _label(layer)
        with self._lock:
            if label not in self._providers:
                raise KeyError(f"layer {label!r} is not tracked; tracked: {sorted(self._providers)}")
            del self._providers[label]
            self._read_errors.pop(label, None)

    def _add_checked(self, checked: Mapping[str, HasStats]) -> None:
        """Track every provider of ``checked`` (labels from `_check_label`), all or none: a
        label another thread tracked since it was checked raises ValueError, tracking nothing."""
        with self._lock:
            taken = sorted(set(checked) & set(self._providers))
            if taken:
                raise ValueError(f"layer {taken[0]!r} is already tracked")
            self._providers.update(checked)

    def _check_label(self, layer: object, provider: object) -> str:
        label = _label(layer)
        if not label.strip():  # Prometheus reads an empty label value as no label
            raise ValueError(f"a layer label must not be empty or blank, got {label!r}")
        _check_provider(label, provider)
        if label in self._providers:
            raise ValueError(f"layer {label!r} is already tracked")
        return label

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Serve the values read on entry, without touching the providers, until exit.

        Wrap CUDA graph capture in it: a device-driven cache's ``stats`` reads device
        counters (a device-to-host copy), which a scrape thread must not issue while
        another thread captures under torch's default (global) capture mode. Pauses nest:
        the values stay frozen until the outermost one exits. The prepare-time histograms
        freeze with the counters, so a scrape never counts more timed prepares than calls.
        """
        with self._lock:
            if self._pause_depth == 0:
                self._frozen = self._read(), _timings(self._providers)
            self._pause_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._pause_depth -= 1
                if self._pause_depth == 0:
                    self._frozen = None

    def _read(self) -> dict[str, CacheStats]:
        """Every tracked provider's stats that could be read (under the lock)."""
        snapshot: dict[str, CacheStats] = {}
        for layer, provider in self._providers.items():
            try:
                stats = provider.stats
                if not isinstance(stats, CacheStats):
                    raise TypeError(f"stats became a {type(stats).__name__}, not a CacheStats")
                stats = CacheStats(*checked_counts(stats))  # a str would fail the whole scrape
            except Exception:  # one layer's failure must not fail the whole scrape
                _LOG.exception("expertcache metrics: reading the stats of layer %r failed; left out", layer)
                self._read_errors[layer] = self._read_errors.get(layer, 0) + 1
                continue
            snapshot[layer] = stats
        return snapshot

    @property
    def is_paused(self) -> bool:
        """Whether scrapes serve the values frozen by `paused`."""
        return self._pause_depth > 0

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot, timings = self._frozen if self._frozen is not None else (self._read(), _timings(self._providers))
            errors = dict(self._read_errors)
        return self._families(snapshot, timings, errors)

    def describe(self) -> Iterator[Metric]:
        """The families `collect` yields, without values: what a registry checks for names
        another collector already uses (without it a duplicate would register silently)."""
        return self._families({}, {}, {})

    def _families(
        self, snapshot: Mapping[str, CacheStats], timings: Mapping[str, _Timing], errors: Mapping[str, int]
    ) -> Iterator[Metric]:
        for name, field, documentation in _COUNTERS:
            family = CounterMetricFamily(f"{self.namespace}_{name}", documentation, labels=["layer"])
            for layer, stats in snapshot.items():
                family.add_metric([layer], getattr(stats, field))
            yield family
        failed = CounterMetricFamily(
            f"{self.namespace}_stats_read_errors",
            "Scrapes that left a layer out because reading its provider's stats raised.",
            labels=["layer"],
        )
        for layer, count in errors.items():
            failed.add_metric([layer], count)
        yield failed
        timing = HistogramMetricFamily(
            f"{self.namespace}_prepare_seconds",
            "Host wall time of prepare() (providers wrapped in TimedProvider).",
            labels=["layer"],
        )
        for layer, (buckets, total) in timings.items():
            timing.add_metric([layer], buckets, total)
        yield timing


def _label(layer: object) -> str:
    """A layer label as the str it is exported as (TypeError: neither a str nor an int)."""
    if isinstance(layer, bool) or not isinstance(layer, (str, numbers.Integral)):
        raise TypeError(f"a layer label is a str or an int, got {type(layer).__name__} {layer!r:.40}")
    return layer if isinstance(layer, str) else str(operator.index(layer))  # np.int64(3) -> "3"


def _timings(providers: Mapping[str, HasStats]) -> dict[str, _Timing]:
    """The prepare-time histogram of every provider wrapped in a `TimedProvider`."""
    return {
        layer: provider.prepare_seconds()
        for layer, provider in providers.items()
        if isinstance(provider, TimedProvider)
    }


def _check_provider(label: str, provider: object) -> None:
    """Refuse what every later scrape would fail on: no ``stats``, or ``stats`` not a `CacheStats`."""
    expected = (
        "expected a provider whose stats is an expertcache.stats.CacheStats (a CachedWeightProvider, a TimedProvider)"
    )
    if isinstance(provider, type):
        raise TypeError(f"provider for layer {label!r} is the class {provider.__name__}, not an instance: {expected}")
    if not hasattr(provider, "stats"):
        raise TypeError(f"provider for layer {label!r} has no stats to expose ({type(provider).__name__}): {expected}")
    stats = provider.stats  # type: ignore[attr-defined]
    if isinstance(stats, CacheStats):
        try:
            checked_counts(stats)
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"provider for layer {label!r} has a CacheStats whose counters are not counts: {error}"
            ) from None
        return
    what = f"provider for layer {label!r} has stats of type {type(stats).__name__}, not a CacheStats"
    if hasattr(provider, "layers") and callable(getattr(provider, "provider", None)):  # an ExpertCacheHandle
        raise TypeError(
            f"{what}; track handle.provider(name) for each name in handle.layers, each under its own label "
            f"(a model's handle sums its expert blocks' stats)"
        )
    raise TypeError(f"{what} ({type(provider).__name__}): {expected}")


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
