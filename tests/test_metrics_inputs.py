"""The metrics refuse, at once and changing nothing, what would break every later scrape.

A registry that already serves the collector's names, a tracked object whose ``stats`` is
not a `CacheStats` (an `ExpertCacheHandle`'s whole-model summary), an empty layer label, a
provider class; and they take what the rest of the library takes (numpy ints as a port or a
label, numpy floats as bucket bounds). After every refusal the registry, collector and
provider work as before. Real ``prometheus_client`` registries; servers on port 0, all closed.
"""

from __future__ import annotations

import socket
import threading
import urllib.request

import numpy as np
import pytest
import torch
from helpers import random_topk, random_weights
from prometheus_client import CollectorRegistry, generate_latest
from transformers_helpers import tiny_model

from expertcache import CachedWeightProvider
from expertcache.integrations.transformers import enable_expert_cache
from expertcache.metrics import CacheCollector, TimedProvider, start_metrics_server


def _provider(seed: int = 0) -> CachedWeightProvider:
    weights = random_weights(4, 8, 4, generator=torch.Generator().manual_seed(seed))
    return CachedWeightProvider(weights, cache_size=2, device="cpu")


def _hits(registry: CollectorRegistry) -> list[str]:
    """The ``expertcache_hits_total`` lines of a scrape of ``registry``."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line.startswith("expertcache_hits_total")]


def _labels(collector: CacheCollector) -> list[str]:
    """The layers ``collector`` exposes (its hits family's samples)."""
    hits = next(family for family in collector.collect() if family.name == "expertcache_hits")
    return [sample.labels["layer"] for sample in hits.samples]


def _scrape(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        return reply.read().decode()


def _refused(error: type[Exception], match: str, port: object = 0, **kwargs) -> None:
    """``start_metrics_server(port, **kwargs)`` raises ``error``; a server wrongly started is closed."""
    with pytest.raises(error, match=match):
        start_metrics_server(port, **kwargs).close()  # close() runs only if the start was accepted


# Finding 1: duplicate names are refused at registration; close() leaves the caller's own.


def test_a_registry_already_holding_the_collector_is_refused_and_keeps_it():
    registry, collector = CollectorRegistry(), CacheCollector({"a": _provider()})
    registry.register(collector)
    threads = threading.active_count()
    _refused(
        ValueError, "already holds this collector", collector=collector, registry=registry, providers={"b": _provider()}
    )
    assert threading.active_count() == threads  # nothing bound: no server thread left behind
    assert _hits(registry) == ['expertcache_hits_total{layer="a"} 0.0']  # the caller's registration, untouched
    assert _labels(collector) == ["a"]  # "b" was not tracked
    registry.unregister(collector)  # still the caller's: it is there to unregister
    server = start_metrics_server(0, collector=collector, registry=registry)  # now the start registers it
    try:
        assert 'expertcache_hits_total{layer="a"} 0.0' in _scrape(server)
    finally:
        server.close()
    assert generate_latest(registry) == b""  # close() unregistered what the start registered


def test_a_second_collector_of_the_same_names_is_refused():
    registry = CollectorRegistry()
    registry.register(CacheCollector({"a": _provider()}))
    _refused(ValueError, "another serving metrics of the same names", registry=registry, providers={"b": _provider()})
    assert generate_latest(registry).decode().count("# HELP expertcache_hits_total") == 1  # one group per name
    assert _hits(registry) == ['expertcache_hits_total{layer="a"} 0.0']
    other = CacheCollector(namespace="other")  # another namespace: no clash
    server = start_metrics_server(0, collector=other, registry=registry, providers={"b": _provider()})
    try:
        text = _scrape(server)
        assert 'expertcache_hits_total{layer="a"}' in text and 'other_hits_total{layer="b"}' in text
    finally:
        server.close()
    assert _hits(registry) == ['expertcache_hits_total{layer="a"} 0.0']
    assert "other_" not in generate_latest(registry).decode()


def test_describe_names_the_families_without_any_provider():
    names = {family.name for family in CacheCollector(namespace="x").describe()}
    assert {"x_hits", "x_misses", "x_prepare_calls", "x_prepare_seconds"} <= names


def test_a_port_in_use_leaves_nothing_registered_or_tracked():
    registry, collector = CollectorRegistry(), CacheCollector()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        in_use = f"cannot serve metrics on 127.0.0.1:{port}"
        _refused(OSError, in_use, port, collector=collector, registry=registry, providers={"0": _provider()})
    assert generate_latest(registry) == b"" and _labels(collector) == []
    server = start_metrics_server(0, collector=collector, registry=registry, providers={"0": _provider()})
    try:
        assert 'expertcache_hits_total{layer="0"} 0.0' in _scrape(server)
    finally:
        server.close()
    assert generate_latest(registry) == b""


# Finding 2: only providers whose stats is a CacheStats are tracked.


def test_a_handle_is_refused_with_the_way_to_track_its_layers():
    handle = enable_expert_cache(tiny_model("qwen3_moe"), cache_size=4)
    try:
        collector = CacheCollector({"0": _provider()})
        registry = CollectorRegistry()
        registry.register(collector)
        with pytest.raises(
            TypeError, match="layer 'model' has stats of type ExpertCacheStats, not a CacheStats"
        ) as info:
            collector.track("model", handle)
        assert "track handle.provider(name) for each name in handle.layers" in str(info.value)
        assert _labels(collector) == ["0"] and len(_hits(registry)) == 1  # scrapes still work
        for name in handle.layers:  # what the message says to do
            collector.track(name, handle.provider(name))
        assert _labels(collector) == ["0", *handle.layers]
    finally:
        handle.disable()


class _StatsAsDict:
    stats = {"hits": 0}


@pytest.mark.parametrize(
    ("provider", "message"),
    [
        (_StatsAsDict(), r"layer '1' has stats of type dict, not a CacheStats .*: expected a provider whose stats is"),
        (CachedWeightProvider, "layer '1' is the class CachedWeightProvider, not an instance: expected a provider"),
        (object(), r"layer '1' has no stats to expose \(object\): expected a provider whose stats is"),
    ],
)
def test_stats_that_are_not_cache_stats_are_refused(provider, message):
    collector = CacheCollector({"0": _provider()})
    with pytest.raises(TypeError, match=message):
        collector.track("1", provider)
    with pytest.raises(TypeError, match=message):  # the server checks before registering or binding
        start_metrics_server(0, collector=collector, providers={"1": provider})
    assert _labels(collector) == ["0"]
    server = start_metrics_server(0, collector=collector)  # the collector still serves
    try:
        assert 'expertcache_hits_total{layer="0"} 0.0' in _scrape(server)
    finally:
        server.close()


# Finding 3: an empty label is no label.


@pytest.mark.parametrize("label", ["", "  "])
def test_an_empty_layer_label_is_refused(label):
    collector = CacheCollector()
    with pytest.raises(ValueError, match="a layer label must not be empty or blank"):
        collector.track(label, _provider())
    with pytest.raises(ValueError, match="a layer label must not be empty or blank"):
        CacheCollector({label: _provider()})
    _refused(
        ValueError, "a layer label must not be empty or blank", collector=collector, providers={label: _provider()}
    )
    assert _labels(collector) == []
    collector.track("0", _provider())  # still takes a good one
    assert _labels(collector) == ["0"]


def test_a_numpy_int_label_is_an_int_label():
    collector = CacheCollector({np.int64(3): _provider()})
    assert _labels(collector) == ["3"]
    with pytest.raises(ValueError, match="layer '3' is already tracked"):
        collector.track(3, _provider())


# Finding 4: a numpy int is a port, as it is a count everywhere else.


def test_a_numpy_port_is_a_port():
    server = start_metrics_server(np.int64(0), providers={"0": _provider()})
    try:
        assert type(server.port) is int and server.port > 0
        assert 'expertcache_hits_total{layer="0"} 0.0' in _scrape(server)
    finally:
        server.close()


@pytest.mark.parametrize(
    ("port", "error", "message"),
    [
        (True, TypeError, "port must be an int in 0..65535, got bool"),
        (0.0, TypeError, "port must be an int in 0..65535, got float"),
        ("9400", TypeError, "port must be an int in 0..65535, got str"),
        (-1, ValueError, "port must be in 0..65535"),
        (np.int32(65536), ValueError, "port must be in 0..65535"),
    ],
)
def test_a_bad_port_is_refused_and_registers_nothing(port, error, message):
    registry, collector = CollectorRegistry(), CacheCollector()
    _refused(error, message, port, collector=collector, registry=registry, providers={"0": _provider()})
    assert generate_latest(registry) == b"" and _labels(collector) == []


# Finding 5: buckets and the wrapped provider.


@pytest.mark.parametrize(
    ("buckets", "error", "message"),
    [
        (None, TypeError, "buckets must be a sequence of seconds .* got NoneType"),  # None is not "the default"
        ("0.1", TypeError, "buckets must be a sequence of seconds .* got str"),
        (np.array(0.1), TypeError, "buckets must be a sequence of seconds .* got ndarray"),  # 0-d
        ((True, 2.0), TypeError, "got an item bool"),  # a bool is not a time
        (("0.1", 1.0), TypeError, "got an item str"),
        ((0.1, 0.01), ValueError, "increasing positive finite seconds"),
        ((0.1, 0.1), ValueError, "increasing positive finite seconds"),
        ((0.0, 1.0), ValueError, "increasing positive finite seconds"),
        ((0.1, float("inf")), ValueError, "increasing positive finite seconds"),
        ((), ValueError, "increasing positive finite seconds"),
    ],
)
def test_bad_buckets_are_refused(buckets, error, message):
    provider = _provider()
    with pytest.raises(error, match=message):
        TimedProvider(provider, buckets=buckets)
    assert TimedProvider(provider).buckets  # the provider is still wrappable


def test_float32_buckets_are_the_seconds_written():
    provider = _provider()
    timed = TimedProvider(provider, buckets=np.array([0.001, 0.01], dtype=np.float32))
    assert timed.buckets == (0.001, 0.01) and all(type(bound) is float for bound in timed.buckets)
    timed.prepare(random_topk(1, 2, 4, generator=torch.Generator().manual_seed(0)))
    counts, _ = timed.prepare_seconds()
    assert [bound for bound, _ in counts] == ["0.001", "0.01", "+Inf"] and counts[-1][1] == 1
    assert provider.stats.calls == 1


def test_a_provider_class_is_not_a_provider():
    with pytest.raises(
        TypeError, match="TimedProvider wraps a provider: an instance .* got the class CachedWeightProvider"
    ):
        TimedProvider(CachedWeightProvider)
    with pytest.raises(TypeError, match="TimedProvider wraps a provider: an instance .* got NoneType"):
        TimedProvider(None)  # type: ignore[arg-type]


class _FlakyStats:
    """A provider whose ``stats`` raises while ``broken`` (a device lost, a provider mid-error)."""

    def __init__(self, provider: CachedWeightProvider) -> None:
        self.provider, self.broken = provider, False

    @property
    def stats(self):
        if self.broken:
            raise RuntimeError("CUDA error: device lost")
        return self.provider.stats


def test_a_layer_whose_stats_raise_is_left_out_of_the_scrape_not_the_others(caplog):
    """Before, the collector's error failed the whole scrape (every layer's metrics lost)."""
    flaky = _FlakyStats(_provider(1))
    steady = _provider(2)
    steady.prepare(torch.tensor([[0, 1], [1, 0]]))
    steady.prepare(torch.tensor([[1, 0]]))  # two hits
    registry = CollectorRegistry()
    registry.register(CacheCollector({"flaky": flaky, "steady": steady}))
    flaky.broken = True
    for scrape in (1, 2):
        text = generate_latest(registry).decode()
        by_layer = [line for line in text.splitlines() if "{layer=" in line]
        assert f'expertcache_hits_total{{layer="steady"}} {float(steady.stats.hits)}' in by_layer
        flaky_lines = [line for line in by_layer if 'layer="flaky"' in line]
        assert flaky_lines == [f'expertcache_stats_read_errors_total{{layer="flaky"}} {float(scrape)}']
    assert "reading the stats of layer 'flaky' failed" in caplog.text
    flaky.broken = False  # served again, its failures still counted
    text = generate_latest(registry).decode()
    assert 'expertcache_hits_total{layer="flaky"} 0.0' in text
    assert 'expertcache_stats_read_errors_total{layer="flaky"} 2.0' in text
