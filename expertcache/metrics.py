"""Prometheus metrics of expert caches, read from ``provider.stats`` at scrape time.

Off by default: nothing here runs until a collector is built or a server started. The
counters are not incremented in the hot path; a custom collector reads each tracked
provider's ``stats`` when Prometheus scrapes. So the values are exactly the provider's own
counters in every mode, including a device-driven cache whose counters live on the GPU
and are read outside CUDA graphs, and ``prepare`` pays nothing for metrics.

Exposed per layer (label ``layer``)::

    expertcache_hits_total, expertcache_misses_total, expertcache_evictions_total,
    expertcache_bytes_copied_total, expertcache_compressed_bytes_copied_total,
    expertcache_prepare_calls_total,
    expertcache_invalid_ids_total (ids outside [0, E) device mode skipped instead of raising),
    expertcache_overflows_total (device-mode calls refused for needing more experts than slots)
    expertcache_prepare_seconds (histogram; only for providers wrapped in TimedProvider)

Usage::

    server = start_metrics_server(9400, providers={"0": layer0, "1": layer1})
    ...  # serve; curl http://127.0.0.1:9400/metrics
    server.close()

Every argument is checked before anything is registered or bound; a start that fails (a
port in use) leaves nothing registered, so starting again on a free port works, and
``close()`` unregisters what the start registered.

This module holds the HTTP endpoint (`start_metrics_server`, `MetricsServer`); the collector
is `expertcache.metrics_collector.CacheCollector` and the timing wrapper
`expertcache.timed_provider.TimedProvider`, both re-exported here.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

from expertcache.metrics_collector import CacheCollector, HasStats
from expertcache.timed_provider import PREPARE_BUCKETS, TimedProvider
from expertcache.validation import check_int

__all__ = [
    "PREPARE_BUCKETS",
    "CacheCollector",
    "HasStats",
    "MetricsServer",
    "TimedProvider",
    "start_metrics_server",
]


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
        """Stop serving, free the port and unregister the collector that `start_metrics_server`
        registered (a second call does nothing). A start never registers a collector its
        registry already held (it raises instead), so a registration of the caller's own is
        never touched."""
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
        TypeError / ValueError: a bad port (an int, numpy ints too), address, collector,
            registry or provider (see `CacheCollector.track`), or a registry that already
            holds the collector or metrics of the same names (ValueError), before anything is
            bound or registered.
        OSError: the address cannot be bound (a port in use); nothing stays registered.
    """
    port = _check_port(port)
    _check_addr(addr, port)
    if collector is not None and not isinstance(collector, CacheCollector):
        raise TypeError(f"collector must be a CacheCollector, got {type(collector).__name__}")
    if registry is not None and not isinstance(registry, CollectorRegistry):
        raise TypeError(f"registry must be a prometheus_client CollectorRegistry, got {type(registry).__name__}")
    collector = collector if collector is not None else CacheCollector()
    new = collector.check_new(providers)
    registry = registry if registry is not None else CollectorRegistry()
    _register(registry, collector)  # a duplicate raises here, before anything is bound
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except BaseException as error:  # a port in use (or a Ctrl-C): the registration goes too
        registry.unregister(collector)
        if isinstance(error, OSError):
            raise OSError(error.errno, f"cannot serve metrics on {addr}:{port}: {error.strerror}") from None
        raise
    try:
        collector._add_checked(new)  # all or none
    except BaseException:
        _stop(server, thread)
        registry.unregister(collector)
        raise
    return MetricsServer(collector, registry, addr, server.server_port, server, thread)


def _register(registry: CollectorRegistry, collector: CacheCollector) -> None:
    """Register ``collector``; the registry refuses metric names it already serves (learnt
    from `CacheCollector.describe`), so a scrape never has two groups of one name."""
    try:
        registry.register(collector)
    except ValueError as error:
        raise ValueError(
            f"the registry already holds this collector, or another serving metrics of the same names "
            f"(namespace {collector.namespace!r}): nothing was registered or bound. Pass a fresh registry, "
            f"or give the second CacheCollector another namespace= ({str(error)[:200]})"
        ) from None


def _check_port(port: object) -> int:
    number = check_int("port", port, expected="an int in 0..65535")  # numpy ints too, as every count
    if not 0 <= number <= 65535:
        raise ValueError(f"port must be in 0..65535 (0: any free port), got {number}")
    return number


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
