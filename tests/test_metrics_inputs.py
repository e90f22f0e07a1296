"""The metrics refuse what would break every later scrape, at once, and change nothing.

A registry that already holds the collector's names, a tracked object whose ``stats`` is
not a `CacheStats` (an `ExpertCacheHandle`'s summary), an empty layer label; and they take
what the rest of the library takes (numpy ints as a port, numpy floats as bucket bounds).
"""

from __future__ import annotations

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


def _provider() -> CachedWeightProvider:
    return CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, device="cpu")


def _series(registry: CollectorRegistry, name: str) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if line.startswith(name)]


def test_a_registry_already_holding_the_collector_is_refused_and_keeps_it():
    registry, collector = CollectorRegistry(), CacheCollector({"0": _provider()})
    registry.register(collector)
    with pytest.raises(ValueError, match="already holds this collector or metrics of the same names"):
        start_metrics_server(0, collector=collector, registry=registry)
    assert _series(registry, "expertcache_hits_total") == ['expertcache_hits_total{layer="0"} 0.0']  # still there


def test_a_second_collector_of_the_same_names_is_refused():
    registry = CollectorRegistry()
    first = start_metrics_server(0, providers={"0": _provider()}, registry=registry)
    try:
        with pytest.raises(ValueError, match="metrics of the same names"):
            start_metrics_server(0, providers={"1": _provider()}, registry=registry)
        text = generate_latest(registry).decode()
        assert text.count("# HELP expertcache_hits_total") == 1  # one family, as the text format requires
    finally:
        first.close()
    other = start_metrics_server(0, providers={"1": _provider()}, registry=registry)  # the names are free again
    other.close()


def test_a_handle_is_refused_with_the_way_to_track_its_layers():
    model = tiny_model("qwen3_moe")
    handle = enable_expert_cache(model, cache_size=4)
    collector = CacheCollector({"0": _provider()})
    with pytest.raises(TypeError, match=r"ExpertCacheStats, not a CacheStats; track handle.provider\(name\)"):
        collector.track("model", handle)
    registry = CollectorRegistry()
    registry.register(collector)
    assert len(_series(registry, "expertcache_hits_total")) == 1  # scrapes still work, "model" untracked
    for name in handle.layers:
        collector.track(name, handle.provider(name))
    assert len(_series(registry, "expertcache_hits_total")) == 1 + len(handle.layers)
    handle.disable()


class _StatsAsDict:
    stats = {"hits": 0}


def test_stats_that_are_not_cache_stats_are_refused_before_serving():
    collector = CacheCollector()
    with pytest.raises(TypeError, match="has stats of type dict, not a CacheStats"):
        start_metrics_server(0, providers={"0": _StatsAsDict()}, collector=collector)
    assert collector.check_new({"0": _provider()})  # nothing was tracked


def test_an_empty_layer_label_is_refused():
    collector = CacheCollector()
    for label in ("", "  "):
        with pytest.raises(ValueError, match="must not be empty"):
            collector.track(label, _provider())
    collector.track("0", _provider())  # still takes a good one


def test_a_numpy_port_is_a_port():
    server = start_metrics_server(np.int64(0), providers={"0": _provider()})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as response:
            assert 'expertcache_hits_total{layer="0"} 0.0' in response.read().decode()
    finally:
        server.close()


@pytest.mark.parametrize(
    ("buckets", "error", "message"),
    [
        (None, TypeError, "buckets must be a sequence of seconds, got NoneType"),
        ("0.1", TypeError, "buckets must be a sequence of seconds, got str"),
        ((True, 2.0), ValueError, "increasing positive finite seconds"),  # a bool is not a time
        ((0.1, 0.01), ValueError, "increasing positive finite seconds"),
        ((), ValueError, "increasing positive finite seconds"),
    ],
)
def test_bad_buckets_are_refused(buckets, error, message):
    with pytest.raises(error, match=message):
        TimedProvider(_provider(), buckets=buckets)


def test_numpy_float_buckets_are_seconds():
    provider = _provider()
    timed = TimedProvider(provider, buckets=np.array([0.001, 0.01], dtype=np.float32))
    assert all(type(bound) is float for bound in timed.buckets)
    assert timed.buckets == (float(np.float32(0.001)), float(np.float32(0.01)))
    timed.prepare(random_topk(1, 2, 4, generator=torch.Generator().manual_seed(0)))
    counts, _ = timed.prepare_seconds()
    assert counts[-1][1] == 1  # the +Inf bucket holds the one call


def test_a_provider_class_is_not_a_provider():
    with pytest.raises(TypeError, match="got the class CachedWeightProvider"):
        TimedProvider(CachedWeightProvider)
