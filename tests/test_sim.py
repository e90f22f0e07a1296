"""`expertcache.sim`: replay semantics, oversize calls, trace streams, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from expertcache import CacheCapacityError
from expertcache.sim import ReplayResult, replay, replay_streams, replay_trace, trace_calls, unbounded
from expertcache.trace import RoutingTrace


def test_hits_and_misses_count_distinct_keys_per_call():
    result = replay([[1, 1, 2], [2, 2, 3, 1]], policy="lru", capacity=3)
    assert (result.hits, result.misses, result.evictions, result.calls) == (2, 3, 0, 2)
    assert result.hit_rate == 2 / 5


def test_a_key_of_the_current_call_is_never_evicted():
    # LRU order before call 2 is [a, b]; the call needs b then c: a goes, not b
    result = replay([["a"], ["b"], ["c", "b"], ["b"]], policy="lru", capacity=2)
    assert (result.hits, result.evictions) == (2, 1)


def test_oversize_calls_run_in_passes_or_are_refused():
    calls = [[0, 1, 2, 3, 4], [0]]
    split = replay(calls, policy="lru", capacity=2)
    assert split.split_calls == 1 and split.calls == 4  # passes [0,1] [2,3] [4], then [0]
    assert (split.hits, split.misses) == (0, 6)
    # resident keys go first: after [3, 4], the call [0..4] serves 3 and 4 in pass 0 (no copy)
    warm = replay([[3, 4], [0, 1, 2, 3, 4]], policy="lru", capacity=2)
    assert (warm.hits, warm.misses, warm.calls) == (2, 5, 4)  # [3,4] | [3,4] [0,1] [2]
    with pytest.raises(CacheCapacityError, match="call 0"):
        replay(calls, policy="lru", capacity=2, oversize="raise")


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"capacity": 0}, ValueError),
        ({"capacity": True}, TypeError),  # a bool is not a count
        ({"capacity": 2.0}, TypeError),
        ({"capacity": 2, "oversize": "drop"}, ValueError),
        ({"capacity": 2, "policy": "nope"}, ValueError),
        ({"capacity": 2, "policy": 3}, TypeError),
        ({"capacity": 2, "overlap_max_ids": 4}, ValueError),  # oversize="passes": it would be ignored
        ({"capacity": 2, "oversize": "overlapped", "overlap_max_ids": 0}, ValueError),
        ({"capacity": 2, "oversize": "overlapped", "overlap_max_ids": True}, ValueError),
        ({"capacity": 2, "oversize": "overlapped", "num_ids": [1]}, ValueError),  # without overlap_max_ids
        ({"capacity": 2, "oversize": "overlapped", "overlap_max_ids": 4, "num_ids": [1, 2]}, ValueError),
        ({"capacity": 2, "oversize": "overlapped", "overlap_max_ids": 4, "num_ids": [-1]}, ValueError),
    ],
)
def test_bad_arguments_are_refused(kwargs, error):
    with pytest.raises(error):
        replay([[0]], **{"policy": "lru", **kwargs})


def test_overlap_max_ids_overlaps_only_the_small_calls():
    """A call of at most ``overlap_max_ids`` ids (its length, or ``num_ids``) takes
    overlapped groups (half the share), a larger one plain groups; and the two differ here."""
    calls = [[0, 1, 2, 3, 4, 5], [6, 7, 0, 1, 2, 3, 4, 5]]  # 6 keys, then 8: neither fits 4 slots
    common = dict(policy="belady", capacity=4, oversize="overlapped")
    overlapped, plain = replay(calls, **common), replay(calls, policy="belady", capacity=4)
    assert replay(calls, **common, overlap_max_ids=8) == overlapped  # every call is small enough
    assert replay(calls, **common, overlap_max_ids=5) == plain
    assert overlapped.calls == 3 + 4 and plain.calls == 2 + 2  # groups of 2 against groups of 4
    mixed = replay(calls, **common, overlap_max_ids=6)  # the first call overlapped, the second not
    assert mixed.calls == 3 + 2
    assert replay(calls, **common, overlap_max_ids=6, num_ids=[6, 8]) == mixed
    assert replay(calls, **common, overlap_max_ids=6, num_ids=[7, 2]).calls == 2 + 4  # counts as given


def test_trace_streams_count_the_ids_the_runtime_gets():
    (layer0, layer1), (both,) = trace_calls(_trace(), scope="layer"), trace_calls(_trace(), scope="global")
    assert layer0.num_ids == (4, 2, 2) and layer1.num_ids == (4, 2)  # layer 1 makes no call for token 2
    assert both.num_ids == (4, 4, 2, 2, 2)
    with pytest.raises(ValueError, match="num_ids"):
        replay_streams([dataclasses.replace(layer0, num_ids=[])], policy="lru", capacity=2, oversize="overlapped",
                       overlap_max_ids=4)  # fmt: skip


def _trace() -> RoutingTrace:
    # 4 tokens, 2 layers, top-2; token 2 has no record at layer 1; forwards [0,1] [2] [3]
    ids = np.array(
        [
            [[0, 1], [2, 3]],
            [[1, 2], [3, 0]],
            [[0, 3], [-1, -1]],
            [[0, 1], [2, 3]],
        ],
        dtype=np.int16,
    )
    return RoutingTrace(ids, forward_starts=[0, 2, 3], num_experts=4)


def test_per_layer_streams():
    layer0, layer1 = trace_calls(_trace(), scope="layer")
    assert layer0.calls == ((0, 1, 2), (0, 3), (0, 1))
    assert layer1.calls == ((2, 3, 0), (2, 3))  # the forward without a record makes no call
    assert layer1.forward_starts == (0, 1) and layer0.num_keys == 4


def test_global_stream_keys_layers_apart_in_execution_order():
    (stream,) = trace_calls(_trace(), scope="global")
    assert stream.calls == ((0, 1, 2), (6, 7, 4), (0, 3), (0, 1), (6, 7))
    assert stream.forward_starts == (0, 2, 3)
    assert stream.num_keys == 8 and stream.distinct_keys == 7


def test_trace_replay_and_the_unbounded_bound():
    trace = _trace()
    per_layer = replay_trace(trace, policy="lru", capacity=4, scope="layer")
    assert (per_layer.hits, per_layer.misses) == (5, 7)  # capacity = E: only first uses miss
    assert unbounded(trace_calls(trace, scope="layer")) == ReplayResult(5, 7, 0, 5)
    pooled = replay_trace(trace, policy="lru", capacity=3, scope="global")
    assert (pooled.lookups, pooled.hits) == (12, 1)
    with pytest.raises(ValueError, match="scope"):
        replay_trace(trace, policy="lru", capacity=3, scope="rank")
