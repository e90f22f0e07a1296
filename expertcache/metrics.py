"""Prometheus metrics of expert caches, read from ``provider.stats`` at scrape time.

Off by default: nothing here runs until a collector is built or a server started. The
counters are not incremented in the hot path; a custom collector reads each tracked
provider's ``stats`` when Prometheus scrapes. So the values are exactly the provider's own
counters in every mode, including a device-driven cache whose counters live on the GPU
and are read outside CUDA graphs, and ``prepare`` pays nothing for metrics.

Exposed per layer (label ``layer``)::

    expertcache_hits_total, expertcache_misses_total, expertcache_evictions_total,
    expertcache_bytes_copied_total, expertcache_compressed_bytes_copied_total,
    expertcache_prepare_calls_total
    expertcache_prepare_seconds (histogram; only for providers wrapped in TimedProvider)

Usage::

    server = start_metrics_server(9400, providers={"0": layer0, "1": layer1})
    ...  # serve; curl http://127.0.0.1:9400/metrics
    server.close()

Every argument is checked before anything is registered or bound; a start that fails (a
port in use) leaves nothing registered, so starting again on a free port works, and
``close()`` unregisters what the start registered.
"""

from __future__ import annotations

import bisect
import math
import re
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from expertcache.provider import ExpertWeightProvider
from expertcache.result import ExpertWeightResult
from expertcache.stats import CacheStats

#: Upper bounds (seconds) of the prepare-time histogram buckets.
PREPARE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)

_COUNTERS = (
    ("hits", "hits", "Distinct experts of a call already resident, summed over calls."),
    ("misses", "misses", "Distinct experts of a call copied in, summed over calls."),
    ("evictions", "evictions", "Resident experts dropped to make room."),
    ("bytes_copied", "bytes_h2d", "Bytes copied from the host store into GPU slots."),
    (
        "compressed_bytes_copied",
        "compressed_bytes_h2d",
        "Bytes those copies read from the host store as stored: the coded bytes of a compressed store "
        "(compression='exponent'), bytes_copied otherwise.",
    ),
    ("prepare_calls", "calls", "prepare() calls that completed."),
)


class HasStats(Protocol):
    """Anything with a `CacheStats` snapshot: a provider, a wrapper, a model's layers."""

    @property
    def stats(self) -> CacheStats: ...


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
        self._frozen: dict[str, CacheStats] | None = None
        self._pause_depth = 0
        self._lock = threading.Lock()  # a read in flight ends before paused() returns
        for layer, provider in self.check_new(providers).items():
            self.track(layer, provider)

    def check_new(self, providers: Mapping[str, HasStats] | None) -> dict[str, HasStats]:
        """``providers`` keyed by label, after checking `track` would take every one.

        Raises:
            TypeError: not a mapping, or a provider without ``stats``. ValueError: a label
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
        """Expose ``provider`` (anything with a ``stats`` `CacheStats`) under ``layer``.

        Raises:
            TypeError: ``provider`` has no ``stats``. ValueError: ``layer`` is already tracked.
        """
        label = self._check_label(layer, provider)
        with self._lock:
            self._providers[label] = provider

    def _check_label(self, layer: object, provider: object) -> str:
        if not isinstance(layer, (str, int)) or isinstance(layer, bool):
            raise TypeError(f"a layer label is a str or an int, got {type(layer).__name__}")
        if not hasattr(provider, "stats"):
            raise TypeError(f"provider for layer {layer!r} has no stats to expose")
        if str(layer) in self._providers:
            raise ValueError(f"layer {str(layer)!r} is already tracked")
        return str(layer)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Serve the values read on entry, without touching the providers, until exit.

        Wrap CUDA graph capture in it: a device-driven cache's ``stats`` reads device
        counters (a device-to-host copy), which a scrape thread must not issue while
        another thread captures under torch's default (global) capture mode. Pauses nest:
        the values stay frozen until the outermost one exits.
        """
        with self._lock:
            if self._pause_depth == 0:
                self._frozen = self._read()
            self._pause_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._pause_depth -= 1
                if self._pause_depth == 0:
                    self._frozen = None

    def _read(self) -> dict[str, CacheStats]:
        return {layer: provider.stats for layer, provider in self._providers.items()}

    @property
    def is_paused(self) -> bool:
        """Whether scrapes serve the values frozen by `paused`."""
        return self._pause_depth > 0

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = self._frozen if self._frozen is not None else self._read()
            providers = dict(self._providers)
        for name, field, documentation in _COUNTERS:
            family = CounterMetricFamily(f"{self.namespace}_{name}", documentation, labels=["layer"])
            for layer, stats in snapshot.items():
                family.add_metric([layer], getattr(stats, field))
            yield family
        timing = HistogramMetricFamily(
            f"{self.namespace}_prepare_seconds",
            "Host wall time of prepare() (providers wrapped in TimedProvider).",
            labels=["layer"],
        )
        for layer, provider in providers.items():
            if isinstance(provider, TimedProvider):
                buckets, total = provider.prepare_seconds()
                timing.add_metric([layer], buckets, total)
        yield timing


@dataclass
class MetricsServer:
    """A running metrics endpoint: ``http://{addr}:{port}/metrics``."""

    collector: CacheCollector
    registry: CollectorRegistry
    addr: str
    port: int
    _server: object
    _thread: object
    _closed: bool = False

    def close(self) -> None:
        """Stop serving, free the port and unregister the collector (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        _stop(self._server, self._thread)
        try:
            self.registry.unregister(self.collector)
        except KeyError:  # the caller unregistered it already
            pass


def start_metrics_server(
    port: int,
    addr: str = "127.0.0.1",
    *,
    providers: Mapping[str, HasStats] | None = None,
    collector: CacheCollector | None = None,
    registry: CollectorRegistry | None = None,
) -> MetricsServer:
    """Serve the caches' metrics over HTTP on ``addr:port`` (port 0: any free port).

    Args:
        port: TCP port, an int in 0..65535; 0 picks a free one (read it back from
            ``MetricsServer.port``).
        addr: address to bind; loopback by default, so nothing is exposed by accident.
        providers: ``{layer label: provider}`` to track (or pass ``collector``).
        collector: an existing `CacheCollector` (providers can be added later).
        registry: the registry to serve (default: a fresh one holding only the collector).

    Raises:
        TypeError / ValueError: a bad port, address, collector, registry or provider,
            before anything is bound or registered.
        OSError: the address cannot be bound (a port in use); nothing stays registered.
    """
    _check_port(port)
    _check_addr(addr, port)
    if collector is not None and not isinstance(collector, CacheCollector):
        raise TypeError(f"collector must be a CacheCollector, got {type(collector).__name__}")
    if registry is not None and not isinstance(registry, CollectorRegistry):
        raise TypeError(f"registry must be a prometheus_client CollectorRegistry, got {type(registry).__name__}")
    collector = collector if collector is not None else CacheCollector()
    new = collector.check_new(providers)
    registry = registry if registry is not None else CollectorRegistry()
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as error:  # a port in use: nothing is registered yet
        raise OSError(error.errno, f"cannot serve metrics on {addr}:{port}: {error.strerror}") from None
    try:
        registry.register(collector)
    except ValueError as error:
        _stop(server, thread)
        raise ValueError(f"the registry already holds this collector or metrics of the same names ({error})") from None
    for layer, provider in new.items():
        collector.track(layer, provider)
    return MetricsServer(collector, registry, addr, server.server_port, server, thread)


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _positive_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_port(port: object) -> None:
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int in 0..65535, got {type(port).__name__} {port!r:.40}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535 (0: any free port), got {port}")


def _check_addr(addr: object, port: int) -> None:
    if not isinstance(addr, str) or not addr.strip():
        raise TypeError(f"addr must be a host name or IP address (str), got {addr!r:.40}")
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise ValueError(f"addr {addr!r} is not an address this machine can resolve ({error})") from None


def _stop(server: object, thread: object) -> None:
    server.shutdown()  # type: ignore[attr-defined]
    server.server_close()  # type: ignore[attr-defined]
    thread.join(timeout=5)  # type: ignore[attr-defined]
