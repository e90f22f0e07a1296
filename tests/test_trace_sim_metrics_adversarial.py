"""Adversarial inputs to the trace loaders, the simulator and the metrics collector.

Each case is something an ordinary user does by mistake or on purpose: a provider dropped
while a collector still tracks it, float or NaN ids handed to a replay, a call stream built
by hand with an impossible number of layers, a folder of traces holding a subfolder or an
empty recording, a layer column out of range, router ids in a ragged list or on the meta
device. Each gets the right answer or one clear error naming what is wrong, and nothing
changes after an error. Real files, real ``prometheus_client`` registries, no stubs.
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
import torch
from helpers import random_weights
from prometheus_client import CollectorRegistry

from expertcache import CachedWeightProvider
from expertcache.metrics import CacheCollector
from expertcache.sim import ReplayResult, TraceCalls, replay, replay_streams, trace_calls, unbounded
from expertcache.trace import RoutingRecorder, RoutingTrace, load_trace, trace_files
from expertcache.trace.errors import TraceFileError


def _provider(seed: int = 0) -> CachedWeightProvider:
    weights = random_weights(4, 8, 4, generator=torch.Generator().manual_seed(seed))
    return CachedWeightProvider(weights, cache_size=2, device="cpu")


def _trace(tokens: int = 2, **fields) -> RoutingTrace:
    ids = np.array([[[0, 1]], [[1, 2]], [[2, 3]]])[:tokens]
    return RoutingTrace(ids, list(range(tokens)), 4, model="m", **fields)


# --- Defect 1: a collector kept every provider it ever tracked, alive and exported ----------


def test_untrack_stops_exporting_a_provider_and_lets_it_be_freed():
    kept, dropped = _provider(0), _provider(1)
    dropped.prepare(torch.tensor([[0, 1], [1, 0]]))
    collector = CacheCollector({"0": dropped, "1": kept})
    registry = CollectorRegistry()
    registry.register(collector)
    assert registry.get_sample_value("expertcache_prepare_calls_total", {"layer": "0"}) == 1
    collector.untrack("0")
    freed = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert freed() is None  # the slots and the host store are not held by the collector
    assert registry.get_sample_value("expertcache_prepare_calls_total", {"layer": "0"}) is None
    assert registry.get_sample_value("expertcache_prepare_calls_total", {"layer": "1"}) == 0
    collector.track(0, _provider(2))  # the label is free again (an int label reads as "0")
    assert registry.get_sample_value("expertcache_prepare_calls_total", {"layer": "0"}) == 0


def test_untracking_a_label_not_tracked_is_refused_and_changes_nothing():
    collector = CacheCollector({"1": _provider()})
    with pytest.raises(KeyError, match=r"layer '7' is not tracked; tracked: \['1'\]"):
        collector.untrack("7")
    with pytest.raises(TypeError, match="a layer label is a str or an int"):
        collector.untrack(1.0)
    collector.untrack(np.int64(1))  # as track: a numpy int is the int label
    with pytest.raises(KeyError, match="not tracked"):
        collector.untrack("1")


# --- Defect 2: a replay counted float, NaN and bool ids as keys ---------------------------


@pytest.mark.parametrize(
    "call",
    [
        np.array([1.0, np.nan, np.nan]),  # NaN != NaN: each one a new key
        torch.tensor([1.5, 1.5]),  # router weights passed instead of ids
        np.array([True, False]),  # a mask passed instead of ids
        torch.tensor([True, True]),
    ],
)
def test_a_call_of_ids_that_are_not_integers_is_refused_naming_it(call):
    with pytest.raises(TypeError, match=r"call 1 holds .*(float|bool).* ids; expert ids are integers"):
        replay([[0, 1], call], policy="lru", capacity=4)


# --- Defect 3: a hand-built call stream with an impossible layer count ----------------------


@pytest.mark.parametrize(
    "num_keys, num_layers, error, message",
    [
        (4, 0, ValueError, "num_layers must be >= 1"),  # was a ZeroDivisionError inside the replay
        (1, 2, ValueError, "num_keys must be a multiple of num_layers"),  # E = 0: ZeroDivisionError
        (9, 2, ValueError, "num_keys must be a multiple of num_layers"),  # E = 4.5: keys misfiled
        (4.0, 1, TypeError, "num_keys must be an int"),
        (8, True, TypeError, "num_layers must be an int"),
    ],
)
def test_trace_calls_of_an_impossible_layer_count_are_refused_when_built(num_keys, num_layers, error, message):
    with pytest.raises(error, match=message):
        TraceCalls([(0, 1)], [0], num_keys, num_layers)


def test_trace_calls_whose_ids_do_not_match_their_calls_are_refused():
    with pytest.raises(ValueError, match=r"num_ids must be empty or hold one count per call \(2\), got 1"):
        TraceCalls([(0,), (1,)], [0, 1], 4, 1, [2])
    stream = TraceCalls([(0,), (5,)], [0, 1], 8, 2, [2, 2])  # a valid one still replays
    result = replay_streams([stream], policy="lru", capacity=2, oversize="overlapped", overlap_max_ids=4)
    assert (result.hits, result.misses) == (0, 2)


# --- Defect 4: a subfolder named like a trace file was loaded as part of the folder ---------


def test_a_subfolder_named_like_a_trace_is_refused_not_loaded(tmp_path):
    _trace().save(tmp_path / "a.npz")
    (tmp_path / "b.npz").mkdir()
    _trace().save(tmp_path / "b.npz" / "c.npz")  # was loaded too: 4 tokens from "one" folder
    message = "b.npz is a folder; a folder of traces holds trace files only"
    with pytest.raises(TraceFileError, match=message):
        trace_files(tmp_path)
    with pytest.raises(TraceFileError, match=message):
        load_trace(tmp_path)


def test_a_link_from_a_folder_to_itself_is_refused_in_one_short_line(tmp_path):
    _trace().save(tmp_path / "a.npz")
    os.symlink(tmp_path, tmp_path / "loop.npz")  # was followed until the path was too long
    with pytest.raises(TraceFileError, match="loop.npz is a folder") as refused:
        load_trace(tmp_path)
    assert len(str(refused.value)) < 300


# --- Defect 5: a folder with an empty recording, or requests inside a file -----------------


def test_an_empty_recording_in_a_folder_adds_nothing(tmp_path):
    alone = _trace()
    for empty in ("0.npz", "z.npz"):  # the empty recording first, then last
        folder = tmp_path / empty
        folder.mkdir()
        alone.save(folder / "a.npz")
        RoutingRecorder(layers=[0], num_experts=4, model="m").trace().save(folder / empty)  # [0, 1, 0]
        loaded = load_trace(folder)
        np.testing.assert_array_equal(loaded.expert_ids, alone.expert_ids)
        np.testing.assert_array_equal(loaded.forward_starts, alone.forward_starts)
        np.testing.assert_array_equal(loaded.request_starts, [0])


def test_every_file_of_a_folder_starts_a_request(tmp_path):
    _trace().save(tmp_path / "a.npz")
    _trace(3, request_starts=[1]).save(tmp_path / "b.npz")  # a request starts inside b, not at 0
    np.testing.assert_array_equal(load_trace(tmp_path).request_starts, [0, 2, 3])


def test_files_that_disagree_on_layers_are_named_by_file(tmp_path):
    _trace().save(tmp_path / "a.npz")
    RoutingTrace(np.array([[[0, 1]]]), [0], 4, model="m", layers=[5]).save(tmp_path / "b.npz")
    with pytest.raises(TraceFileError, match=r"b.npz has layers \[5\] top-2, a.npz \[0\] top-2"):
        load_trace(tmp_path)


# --- Defect 6: a layer column out of range read another layer ------------------------------


@pytest.mark.parametrize(
    "column, error",
    [(-1, ValueError), (1, ValueError), (0.0, TypeError), (True, TypeError)],  # -1 read the last layer
)
def test_calls_of_a_column_out_of_range_are_refused_at_once(column, error):
    trace = _trace()
    with pytest.raises(error, match="column"):
        trace.calls(column)
    assert [call.tolist() for call in trace.calls(np.int64(0))] == [[[0, 1]], [[1, 2]]]


# --- Defect 7: router ids the recorder could not read gave numpy's or torch's own error ------


@pytest.mark.parametrize(
    "topk_ids, message",
    [
        ([[1, 2], [3]], r"topk_ids must be a rectangular \[T, K\] array of integer ids"),
        (torch.empty(2, 2, dtype=torch.int64, device="meta"), "topk_ids is on the meta device"),
        (torch.tensor([[1, 2]]).to_sparse(), "topk_ids must be a dense tensor"),
    ],
)
def test_ids_the_recorder_cannot_read_are_refused_in_its_own_words(topk_ids, message):
    recorder = RoutingRecorder(layers=[0], num_experts=4)
    recorder.record(0, [[0, 1]])
    with pytest.raises((TypeError, ValueError), match=message):
        recorder.record(0, topk_ids)
    assert recorder.trace().expert_ids.tolist() == [[[0, 1]]]  # nothing recorded, no forward closed


def test_trace_calls_still_read_a_real_stream():
    streams = trace_calls(_trace(3), scope="global")
    assert streams[0].calls == ((0, 1), (1, 2), (2, 3))


# --- Defect 8: a trace or one stream where a replay takes a list of calls or streams ---------


def test_a_trace_or_a_stream_given_to_the_wrong_replay_says_which_to_call():
    trace = _trace()
    stream = trace_calls(trace, scope="layer")[0]
    for calls in (trace, stream):
        with pytest.raises(TypeError, match=r"replay_trace\(trace, \.\.\.\).*replay_streams\(\[stream\], \.\.\.\)"):
            replay(calls, policy="lru", capacity=4)
        with pytest.raises(TypeError, match=r"streams must be a sequence of TraceCalls .*got a "):
            replay_streams(calls, policy="lru", capacity=4)
        with pytest.raises(TypeError, match=r"streams must be a sequence of TraceCalls .*got a "):
            unbounded(calls)
    with pytest.raises(TypeError, match=r"streams\[1\] is a list, not a TraceCalls"):
        replay_streams([stream, [[0, 1]]], policy="lru", capacity=4)
    assert replay_streams([stream], policy="lru", capacity=4) == replay(stream.calls, policy="lru", capacity=4)


@pytest.mark.parametrize("other", [1, (0, 0, 0, 0), None])
def test_a_replay_result_adds_only_replay_results(other):
    """Summing results with anything else was an AttributeError from inside ``__add__``."""
    result = ReplayResult(1, 2, 0, 1)
    with pytest.raises(TypeError, match="ReplayResult"):
        result + other  # noqa: B018
    assert result + ReplayResult(1, 0, 0, 1) == ReplayResult(2, 2, 0, 2)  # control
