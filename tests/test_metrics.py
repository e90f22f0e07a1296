"""Metrics endpoint scraped over loopback with real HTTP; values must equal ``stats``."""

from __future__ import annotations

import threading
import urllib.request

import pytest
import torch
from conftest import devices
from helpers import random_topk, random_weights
from prometheus_client.parser import text_string_to_metric_families

from expertcache import CachedWeightProvider, SlotPool
from expertcache.metrics import TimedProvider, start_metrics_server


def _scrape(server) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples, name, layer, **labels):
    return samples[(name, tuple(sorted({"layer": layer, **labels}.items())))]


def test_scrape_equals_stats_per_layer():
    generator = torch.Generator().manual_seed(3)
    weights = random_weights(8, 16, 8, generator=generator)
    pool = SlotPool.for_weights(weights, 12, device="cpu")  # a share of 6: a call of 3 x 2 ids fits
    layers = {
        "0": TimedProvider(CachedWeightProvider(weights, pool=pool, layer=0)),
        "1": CachedWeightProvider(weights, pool=pool, layer=1),
    }
    server = start_metrics_server(0, providers=layers)
    try:
        assert server.addr == "127.0.0.1" and server.port > 0
        empty = _scrape(server)
        assert _value(empty, "expertcache_hits_total", "0") == 0
        for _ in range(25):
            for provider in layers.values():
                provider.prepare(random_topk(3, 2, 8, generator=generator))
        samples = _scrape(server)
        for layer, provider in layers.items():
            stats = provider.stats
            assert stats.hits > 0 and stats.misses > 0 and stats.evictions > 0
            assert _value(samples, "expertcache_hits_total", layer) == stats.hits
            assert _value(samples, "expertcache_misses_total", layer) == stats.misses
            assert _value(samples, "expertcache_evictions_total", layer) == stats.evictions
            assert _value(samples, "expertcache_bytes_copied_total", layer) == stats.bytes_h2d
            assert _value(samples, "expertcache_prepare_calls_total", layer) == stats.calls == 25
        timed = _value(samples, "expertcache_prepare_seconds_count", "0")
        assert timed == 25
        assert _value(samples, "expertcache_prepare_seconds_bucket", "0", le="+Inf") == 25
        assert ("expertcache_prepare_seconds_count", (("layer", "1"),)) not in samples
        # values are read at scrape time: one more call shows up in the next scrape
        layers["1"].prepare(random_topk(1, 2, 8, generator=generator))
        again = _scrape(server)
        assert _value(again, "expertcache_prepare_calls_total", "1") == 26
    finally:
        server.close()


def test_paused_collector_serves_the_values_read_on_entry():
    generator = torch.Generator().manual_seed(4)
    provider = CachedWeightProvider(random_weights(6, 8, 4, generator=generator), cache_size=3, device="cpu")
    server = start_metrics_server(0, providers={"7": provider})
    try:
        provider.prepare(random_topk(2, 2, 6, generator=generator))
        with server.collector.paused():  # e.g. around CUDA graph capture
            provider.prepare(random_topk(2, 2, 6, generator=generator))
            during = _scrape(server)
        after = _scrape(server)
    finally:
        server.close()
    assert _value(during, "expertcache_prepare_calls_total", "7") == 1
    assert _value(after, "expertcache_prepare_calls_total", "7") == 2 == provider.stats.calls


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])  # device: counters live in a device tensor
def test_scrape_equals_stats_in_both_modes(device, mode):
    generator = torch.Generator().manual_seed(5)
    provider = CachedWeightProvider(
        random_weights(8, 16, 8, generator=generator), cache_size=4, device=device, mode=mode
    )
    server = start_metrics_server(0, providers={"0": provider})
    try:
        for _ in range(12):
            provider.prepare(random_topk(2, 2, 8, generator=generator).to(device))
        samples = _scrape(server)
    finally:
        server.close()
    stats = provider.stats
    assert stats.calls == 12 and stats.evictions > 0
    for name, field in [("hits", "hits"), ("misses", "misses"), ("evictions", "evictions")]:
        assert _value(samples, f"expertcache_{name}_total", "0") == getattr(stats, field)
    assert _value(samples, "expertcache_bytes_copied_total", "0") == stats.bytes_h2d


@pytest.mark.gpu
def test_scraping_while_a_device_mode_step_is_captured_and_replayed():
    """A scrape thread runs throughout; capture happens inside ``paused()``; exact at the end."""
    generator = torch.Generator().manual_seed(6)
    provider = CachedWeightProvider(
        random_weights(16, 64, 32, generator=generator), cache_size=6, device="cuda", mode="device"
    )
    ids = random_topk(1, 2, 16, generator=generator).cuda()
    server = start_metrics_server(0, providers={"0": provider})
    stop, errors = threading.Event(), []

    def scrape_forever():
        while not stop.is_set():
            try:
                _scrape(server)
            except Exception as error:  # reported by the main thread
                errors.append(error)

    scraper = threading.Thread(target=scrape_forever)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            provider.prepare(ids)  # warm-up: compiles the kernels
        torch.cuda.current_stream().wait_stream(side)
        scraper.start()
        graph = torch.cuda.CUDAGraph()
        with server.collector.paused(), torch.cuda.graph(graph):
            provider.prepare(ids)
        for _ in range(50):
            ids.copy_(random_topk(1, 2, 16, generator=generator))
            graph.replay()
        torch.cuda.synchronize()
    finally:
        stop.set()
        if scraper.is_alive():
            scraper.join()
    try:
        samples = _scrape(server)
    finally:
        server.close()
    assert not errors, errors
    stats = provider.stats
    assert stats.misses > 0
    assert _value(samples, "expertcache_hits_total", "0") == stats.hits
    assert _value(samples, "expertcache_misses_total", "0") == stats.misses
    assert _value(samples, "expertcache_prepare_calls_total", "0") == stats.calls
