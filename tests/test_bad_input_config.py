"""Bad settings at the Python entry points: config, byte sizes, the transformers integration,
the planner and simulator, the metrics server. Each raises ValueError/TypeError naming what is
wrong before anything changes; settings are never silently dropped.
"""

from __future__ import annotations

import argparse
import socket
import urllib.request

import numpy as np
import pytest
import torch
from helpers import random_topk, random_weights
from transformers_helpers import tiny_model

from expertcache import CachedWeightProvider
from expertcache.cli import add_cache_arguments, cache_config_from_args
from expertcache.config import ExpertCacheConfig, check_mode_runs_here, parse_byte_size
from expertcache.integrations.transformers import enable_expert_cache
from expertcache.metrics import CacheCollector, TimedProvider, start_metrics_server
from expertcache.plan_plot import check_png_path
from expertcache.planner import plan
from expertcache.sim import replay, replay_trace
from expertcache.trace import RoutingRecorder, RoutingTrace


@pytest.mark.parametrize(
    "fields, error, message",
    [
        ({"policy": "belady"}, ValueError, "clairvoyant, for simulation only"),  # failed at the first prepare
        ({"policy": "fifo"}, ValueError, "unknown eviction policy 'fifo'"),
        ({"policy": None}, ValueError, "unknown eviction policy None"),
        ({"cache_size": 0}, ValueError, "must be between 1 and 2147483647"),
        ({"cache_size": 2**31}, ValueError, "must be between 1 and 2147483647"),
        ({"cache_size": 4.0}, TypeError, "cache_size must be an int, got float"),
        ({"cache_size": True}, TypeError, "cache_size must be an int, got bool"),
        ({"mode": "gpu"}, ValueError, "mode must be one of host, device"),
        ({"mode": "device", "policy": "lfu"}, ValueError, "only the lru policy"),
        ({"budget": ["global"]}, ValueError, "budget must be one of"),
        ({"pin_budget_bytes": -1}, ValueError, "pin_budget_bytes must be >= 0"),
        ({"pin_budget_bytes": 1.5e9}, TypeError, "pin_budget_bytes must be an int"),
        ({"device": "tpu"}, ValueError, "not a device: 'tpu'"),
        ({"device": "meta"}, ValueError, "unsupported device 'meta'"),
        ({"device": 0}, TypeError, "device must be a str"),
        ({"device": "cpu:1"}, ValueError, "there is one CPU device"),  # was quietly "cpu"
    ],
)
def test_config_refuses_at_construction(fields, error, message):
    with pytest.raises(error, match=message):
        ExpertCacheConfig(**{"cache_size": 4, **fields})


def test_config_normalises_what_means_the_same():
    config = ExpertCacheConfig(cache_size=4, policy="LRU", device="cpu:0", mode="device")
    assert (config.policy, config.device) == ("lru", "cpu")  # device mode then takes "LRU" too
    assert config == ExpertCacheConfig(cache_size=4, policy="lru", device="cpu", mode="device")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("9007199254740992", 2**53),  # exactly, where a float would round
        ("9007199254740993", "is more than 9007199254740992 bytes"),  # was silently rounded
        ("9" * 400, "is more than"),  # was OverflowError outside argparse
        ("1.5 GiB", 3 * 2**29),
        ("0.1 kB", 100),
        ("1.0000001 kB", 1000),  # a fraction of a byte is dropped, exactly
        ("8 PiB", 2**53),
        ("1e9", "not a byte size"),
        ("-5", "not a byte size"),
        ("nan", "not a byte size"),
        ("12 parsecs", "not a byte size"),
    ],
)
def test_byte_sizes_are_read_exactly(text, expected):
    if isinstance(expected, int):
        assert parse_byte_size(text) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            parse_byte_size(text)


def test_cache_flags_refuse_device_mode_where_it_cannot_run(monkeypatch):
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    args = parser.parse_args(["--moe-expert-cache-size", "4", "--moe-expert-cache-mode", "device"])
    import expertcache.kernels._launch as launch

    monkeypatch.setattr(launch, "INTERPRETED", False)  # kernels compiled, as without TRITON_INTERPRET
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use mode 'host'"):
            cache_config_from_args(args)
    with pytest.raises(ValueError, match="not on the CPU"):
        check_mode_runs_here("device", "cpu")
    monkeypatch.setattr(launch, "INTERPRETED", True)  # kernels interpreted: the CPU can run them
    assert cache_config_from_args(args).mode == "device"
    check_mode_runs_here("device", "cpu")
    check_mode_runs_here("host", "cpu")


def test_enable_expert_cache_refuses_what_it_would_ignore():
    model = tiny_model("mixtral")
    config = ExpertCacheConfig(cache_size=4)
    with pytest.raises(TypeError, match="must be a torch.nn.Module .* got str"):
        enable_expert_cache("model", cache_size=4)  # was a bare AttributeError
    with pytest.raises(TypeError, match="policy beside a config would be ignored"):
        enable_expert_cache(model, config, policy="lfu")  # the policy was dropped
    with pytest.raises(TypeError, match="pin_budget_bytes, mode beside a config"):
        enable_expert_cache(model, config, mode="host", pin_budget_bytes=0)
    with pytest.raises(TypeError, match="config=None turns the cache off, so cache_size, recorder would be ignored"):
        enable_expert_cache(model, None, cache_size=4, recorder=RoutingRecorder())
    handle = enable_expert_cache(model, cache_size=4, policy="lfu", budget="per-layer")
    assert handle.config.policy == "lfu"  # keywords alone apply
    handle.disable()
    handle = enable_expert_cache(model, config)
    assert handle.config == config
    handle.disable()


def _trace(tokens: int = 6) -> RoutingTrace:
    ids = np.arange(tokens * 2 * 2).reshape(tokens, 2, 2) % 8
    return RoutingTrace(ids, list(range(tokens)), num_experts=8, source="synthetic")


@pytest.mark.parametrize(
    "trace, kwargs, error, message",
    [
        (_trace(0), {}, ValueError, "synthetic.*has no routing records .*nothing to plan on"),  # was ZeroDivisionError
        (RoutingTrace(np.full((3, 1, 2), -1), [0], num_experts=4), {}, ValueError, "has no routing records"),
        (_trace(), {"policies": []}, ValueError, "no policy to score"),
        (_trace(), {"policies": ["lru", "belady"]}, ValueError, "'belady' is a bound"),
        (_trace(), {"policies": "lru"}, TypeError, "sequence of policy names"),
        (_trace(), {"expert_bytes": 0}, ValueError, "expert_bytes must be at least 1"),
        (_trace(), {"gpu_budget_bytes": 1.5}, TypeError, "gpu_budget_bytes must be an int"),
        (_trace(), {"bandwidth_bytes_per_second": float("nan")}, ValueError, "positive finite number"),
        (_trace(), {"model_layers": 1}, ValueError, "model_layers must be at least 2 \\(the trace records 2\\)"),
        (_trace(), {"fractions": [0.5, 1.5]}, ValueError, "fractions must be numbers in \\(0, 1\\]"),
        (_trace(), {"min_gain": float("inf")}, ValueError, "min_gain"),
        ("trace.npz", {}, TypeError, "trace must be a RoutingTrace"),
    ],
)
def test_plan_refuses_bad_arguments(trace, kwargs, error, message):
    with pytest.raises(error, match=message):
        plan(trace, **{"expert_bytes": 1000, "gpu_budget_bytes": 4000, **kwargs})


def test_replay_refuses_bad_calls_and_needs_no_memory_for_a_huge_capacity():
    with pytest.raises(ValueError, match="has no routing records"):
        replay_trace(_trace(0), policy="lru", capacity=2, scope="layer")  # was ZeroDivisionError in the planner
    with pytest.raises(TypeError, match="call 1 must be a sequence of keys, got int"):
        replay([[0], 5], policy="lru", capacity=2)
    with pytest.raises(TypeError, match="call 0 holds a key that is not hashable"):
        replay([[[0]]], policy="lru", capacity=2)
    with pytest.raises(ValueError, match="forward_starts must be non-negative call indices"):
        replay([[0]], policy="lru", capacity=2, forward_starts=[-1])
    huge = replay([[0, 1], [2], [0]], policy="lru", capacity=2**40)  # a table of 3 slots, same counts
    assert (huge.hits, huge.misses, huge.evictions) == (1, 3, 0)
    assert huge == replay([[0, 1], [2], [0]], policy="lru", capacity=3)


def test_a_plot_path_is_checked_before_drawing(tmp_path):
    with pytest.raises(ValueError, match="the folder .*missing does not exist"):
        check_png_path(tmp_path / "missing" / "plot.png")
    with pytest.raises(ValueError, match="ending in .png"):
        check_png_path(tmp_path / "plot.svg")
    assert check_png_path(tmp_path / "plot.png") == tmp_path / "plot.png"


def _provider() -> CachedWeightProvider:
    return CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, device="cpu")


@pytest.mark.parametrize(
    "port, error, message",
    [(-1, ValueError, "port must be in 0..65535"), (70000, ValueError, "port must be in 0..65535"),
     ("x", TypeError, "port must be an int"), (True, TypeError, "port must be an int"),
     (9400.0, TypeError, "port must be an int")],
)  # fmt: skip
def test_a_bad_port_registers_nothing(port, error, message):
    collector = CacheCollector()
    with pytest.raises(error, match=message):
        start_metrics_server(port, providers={"0": _provider()}, collector=collector)
    assert collector.check_new({"0": _provider()})  # "0" was not tracked


def test_a_bad_address_or_provider_registers_nothing():
    collector = CacheCollector()
    with pytest.raises(ValueError, match="addr 'no such host.invalid' is not an address"):
        start_metrics_server(0, "no such host.invalid", providers={"0": _provider()}, collector=collector)
    with pytest.raises(TypeError, match="provider for layer '1' has no stats"):
        start_metrics_server(0, providers={"0": _provider(), "1": object()}, collector=collector)
    with pytest.raises(ValueError, match="two providers are labelled layer '0'"):
        start_metrics_server(0, providers={0: _provider(), "0": _provider()}, collector=collector)
    assert collector.check_new({"0": _provider()})
    with pytest.raises(ValueError, match="buckets must be increasing"):
        TimedProvider(_provider(), buckets=(0.1, float("nan")))
    with pytest.raises(ValueError, match="namespace must be a Prometheus metric name"):
        CacheCollector(namespace="expert cache")


def test_a_failed_start_leaves_nothing_registered_so_a_retry_works():
    from prometheus_client import CollectorRegistry

    registry, collector, provider = CollectorRegistry(), CacheCollector(), _provider()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError):
            start_metrics_server(
                busy.getsockname()[1], providers={"0": provider}, collector=collector, registry=registry
            )
    server = start_metrics_server(0, providers={"0": provider}, collector=collector, registry=registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as reply:
            assert 'expertcache_hits_total{layer="0"} 0.0' in reply.read().decode()
        with pytest.raises(ValueError, match="already tracked"):
            collector.track("0", provider)  # a second provider under one label was silently replaced
    finally:
        server.close()
    server.close()  # a second close does nothing
    again = start_metrics_server(0, collector=collector, registry=registry)  # close() unregistered
    again.close()


def test_nested_pauses_keep_the_outer_one_frozen():
    provider = _provider()
    collector = CacheCollector({"0": provider})

    def calls() -> float:
        family = next(f for f in collector.collect() if f.name == "expertcache_prepare_calls")
        return family.samples[0].value

    generator = torch.Generator().manual_seed(0)
    with collector.paused():
        provider.prepare(random_topk(1, 2, 4, generator=generator))
        with collector.paused():
            provider.prepare(random_topk(1, 2, 4, generator=generator))
        assert collector.is_paused and calls() == 0  # leaving the inner one unfroze the outer one before
    assert not collector.is_paused and calls() == 2
