"""LRU and ARC hit counts equal libCacheSim's on the same request streams.

libCacheSim serves one request at a time, so the stream is each call's distinct keys in
order, one request each, replayed here as one-key calls (our per-call protection has no
effect there). `benchmarks/libcachesim_crosscheck.py` runs the full matrix over every trace.
"""

from __future__ import annotations

import random

import pytest
from helpers import real_traces

from expertcache.sim import replay, trace_calls
from expertcache.trace import load_trace

libcachesim = pytest.importorskip("libcachesim")

TRACES = real_traces()
CACHES = {"lru": libcachesim.LRU, "arc": libcachesim.ARC}


def _theirs(policy: str, keys: list[int], capacity: int) -> int:
    cache = CACHES[policy](cache_size=capacity)
    return sum(bool(cache.get(libcachesim.Request(obj_size=1, obj_id=key + 1))) for key in keys)


def _ours(policy: str, keys: list[int], capacity: int) -> int:
    return replay([[key] for key in keys], policy=policy, capacity=capacity).hits


@pytest.mark.parametrize("policy", sorted(CACHES))
@pytest.mark.parametrize("capacity", [1, 3, 16, 50])  # 1: every miss evicts; 50: ~ all fit
@pytest.mark.parametrize("seed", range(3))
def test_zipf_streams(policy, capacity, seed):
    generator = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(64)]
    keys = generator.choices(range(64), weights=weights, k=3000)
    assert _ours(policy, keys, capacity) == _theirs(policy, keys, capacity)


@pytest.mark.skipif(not TRACES.is_dir(), reason="no real routing traces (../shared/traces)")
@pytest.mark.parametrize("policy", sorted(CACHES))
@pytest.mark.parametrize(
    "path",
    [
        "olmoe-1b-7b-0924__cerebras-assesment2/moe_routes.jsonl",
        "mixtral-8x7b-instruct-fp8__speculative-moe/routing_raw.jsonl",
    ],
)
def test_real_trace_streams(policy, path):
    trace = load_trace(TRACES / path)
    for scope in ("layer", "global"):
        streams = trace_calls(trace, scope=scope)
        capacity = streams[0].num_keys // 4
        for stream in streams:
            keys = [key for call in stream.calls for key in call]
            assert _ours(policy, keys, capacity) == _theirs(policy, keys, capacity)
