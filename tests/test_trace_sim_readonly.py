"""A `TraceCalls` stream and a `RoutingRecorder`'s model description cannot be changed in place.

Both were checked by their constructors (a recorder's also by `describe`) and then open to
``stream.calls.append(...)`` or ``recorder.num_experts = 0``: a later replay, simulation or
record then used state no check had seen. Like `RoutingTrace` (tests/test_trace_sim_hardening.py),
a stream now holds tuples and a recorder read-only properties.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import real_traces

from expertcache.sim import TraceCalls, replay_streams, trace_calls, unbounded
from expertcache.trace import RoutingRecorder, RoutingTrace, load_trace

TRACES = real_traces()
OLMOE = TRACES / "olmoe-1b-7b-0924__cerebras-assesment2" / "moe_routes.jsonl"
needs_traces = pytest.mark.skipif(not OLMOE.exists(), reason="no real routing traces (.traces or ../shared/traces)")

# --- TraceCalls: tuples all the way down --------------------------------------------------------


def _trace() -> RoutingTrace:
    # 3 tokens, 2 layers, top-2, E = 4; forwards [0, 1] [2]; token 2 has no record at layer 1
    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[0, 3], [-1, -1]]], dtype=np.int16)
    return RoutingTrace(ids, forward_starts=[0, 2], num_experts=4)


def _streams() -> list[TraceCalls]:
    """A stream of each kind: per layer, global, and hand-built from lists."""
    trace = _trace()
    hand_built = TraceCalls([[0, 1], [2]], [0, 1], 4, 1, [2, 2])
    return [*trace_calls(trace, scope="layer"), *trace_calls(trace, scope="global"), hand_built]


def _contents(stream: TraceCalls) -> tuple[list, list, list]:
    """The stream's calls, starts and id counts as fresh lists: what a change would alter."""
    return [list(call) for call in stream.calls], list(stream.forward_starts), list(stream.num_ids)


@pytest.mark.parametrize("kind", range(4), ids=["layer 0", "layer 1", "global", "hand-built"])
@pytest.mark.parametrize(
    "change",
    [
        lambda stream: stream.calls.append((3,)),  # one call more than num_ids counts
        lambda stream: stream.calls.clear(),  # a stream without a call (distinct_keys of nothing)
        lambda stream: stream.forward_starts.append(99),  # a forward pass past the last call
        lambda stream: stream.num_ids.pop(),  # one count fewer than the calls
        lambda stream: stream.calls.__setitem__(0, (9, 9)),  # a key of no layer, a repeated key
    ],
    ids=["append a call", "clear the calls", "append a start", "pop an id count", "replace a call"],
)
def test_changing_a_stream_in_place_is_refused_and_changes_nothing(kind, change):
    stream = _streams()[kind]
    kept = _contents(stream)
    with pytest.raises((AttributeError, TypeError), match="tuple"):
        change(stream)
    assert _contents(stream) == kept


def test_a_call_of_a_hand_built_stream_cannot_grow():
    stream = TraceCalls([[0, 1], [2]], [0, 1], 8, 2)  # E = 4: keys 0 .. 3 are layer 0's
    with pytest.raises(AttributeError, match="tuple"):
        stream.calls[0].append(5)  # type: ignore[attr-defined]  # a key of layer 1 in a layer 0 call
    assert stream.calls == ((0, 1), (2,))
    assert unbounded([stream]).misses == 3


def test_a_stream_is_tuples_and_owns_them():
    calls, starts, ids = [[0, 1], [2]], [0, 1], [2, 2]
    stream = TraceCalls(calls, starts, 4, 1, ids)
    calls[0].append(3)  # the caller's lists: the stream holds its own copies
    calls.append([3])
    starts.append(2)
    ids.append(1)
    assert stream.calls == ((0, 1), (2,)) and stream.forward_starts == (0, 1) and stream.num_ids == (2, 2)
    for stream in _streams():
        assert type(stream.calls) is tuple and all(type(call) is tuple for call in stream.calls)
        assert type(stream.forward_starts) is tuple and type(stream.num_ids) is tuple


def test_a_stream_of_arrays_holds_python_ints_and_replays_as_before():
    # the ids of an array or tensor call, by value (a tensor's items would be 0-d tensors)
    stream = TraceCalls([np.array([0, 1]), torch.tensor([1, 2])], np.array([0, 1]), 4, 1, torch.tensor([2, 2]))
    assert stream.calls == ((0, 1), (1, 2)) and stream.forward_starts == (0, 1) and stream.num_ids == (2, 2)
    assert all(type(key) is int for call in stream.calls for key in call)
    rows = TraceCalls(np.array([[0, 1], [1, 2]]), [0, 1], 4)  # a 2-D array: each row a call
    assert rows.calls == stream.calls
    result = replay_streams([stream], policy="lru", capacity=2, oversize="overlapped", overlap_max_ids=4)
    assert (result.hits, result.misses) == (1, 3)


@pytest.mark.parametrize(
    ("calls", "message"),
    [
        ("01", "calls must be a sequence of calls, got a str"),
        ([(0,), "01"], r"calls\[1\] must be a sequence, got a str"),  # as a tuple: keys '0' and '1'
        ([np.zeros((2, 2), dtype=np.int64)], r"calls\[0\] must be a 1-D sequence, got a 2-D ndarray"),
    ],
)
def test_a_stream_of_calls_that_are_no_sequences_of_ids_is_refused(calls, message):
    with pytest.raises(TypeError, match=message):
        TraceCalls(calls, [0], 4)


def test_replace_makes_a_changed_stream_and_checks_it():
    (stream,) = trace_calls(_trace(), scope="global")
    shorter = dataclasses.replace(stream, calls=[*stream.calls[:-1]], num_ids=[*stream.num_ids[:-1]])
    assert shorter.calls == stream.calls[:-1] and type(shorter.calls) is tuple
    assert unbounded([shorter]).calls == unbounded([stream]).calls - 1
    with pytest.raises(ValueError, match="num_ids must be empty or hold one count per call"):
        dataclasses.replace(stream, calls=[*stream.calls, (0,)])


@needs_traces
def test_streams_of_a_real_trace_are_read_only_and_replay_the_same():
    trace = load_trace(OLMOE)
    for scope in ("layer", "global"):
        streams = trace_calls(trace, scope=scope)
        with pytest.raises(AttributeError):
            streams[0].calls.append(streams[0].calls[0])  # type: ignore[attr-defined]
        as_lists = [
            TraceCalls(
                [list(call) for call in stream.calls], list(stream.forward_starts), stream.num_keys, stream.num_layers
            )
            for stream in streams
        ]
        slots = streams[0].num_keys // 4
        assert replay_streams(streams, policy="lru", capacity=slots) == replay_streams(
            as_lists, policy="lru", capacity=slots
        )


# --- RoutingRecorder: its model description is read-only -------------------------------------


_DESCRIPTION = {"layers": (3, 7), "num_experts": 8, "model": "m", "source": "s"}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("layers", (3,)),  # a column fewer than the records already taken
        ("layers", None),  # record() and trace() then refuse every layer
        ("num_experts", 0),  # below every id already recorded, and no valid E
        ("num_experts", 4),  # below an id already recorded (7)
        ("model", 5),  # not a str: trace() would fail with the records taken
        ("source", "other"),  # even a valid value: set by the constructor only
    ],
)
def test_assigning_a_recorder_s_description_is_refused_and_changes_nothing(name, value):
    recorder = RoutingRecorder(layers=[3, 7], num_experts=8, model="m", source="s")
    recorder.record(3, np.array([[0, 7]]))
    with pytest.raises(AttributeError, match=name):
        setattr(recorder, name, value)
    with pytest.raises(AttributeError, match=name):
        delattr(recorder, name)
    assert {key: getattr(recorder, key) for key in _DESCRIPTION} == _DESCRIPTION
    recorder.record(7, np.array([[1, 7]]))  # recording goes on against the checked description
    with pytest.raises(ValueError, match=r"expert ids must be in \[-1, 8\)"):
        recorder.record(3, np.array([[0, 8]]))
    trace = recorder.trace()
    assert trace.layers.tolist() == [3, 7] and trace.num_experts == 8 and (trace.model, trace.source) == ("m", "s")
    assert trace.expert_ids.tolist() == [[[0, 7], [1, 7]]]


def test_a_recorder_described_later_is_read_only_too():
    recorder = RoutingRecorder()
    with pytest.raises(AttributeError, match="layers"):
        recorder.layers = (0, 1)  # type: ignore[misc]  # not a way around describe's checks
    assert recorder.layers is None and recorder.num_experts is None and recorder.model == ""
    recorder.describe(layers=[0, 1], num_experts=4, model="tiny")  # the one way to set them
    assert (recorder.layers, recorder.num_experts, recorder.model) == ((0, 1), 4, "tiny")
    with pytest.raises(AttributeError, match="num_experts"):
        recorder.num_experts = 2  # type: ignore[misc]
    with pytest.raises(AttributeError, match="model"):
        recorder.model = ""  # type: ignore[misc]
    recorder.describe(layers=[0, 1], num_experts=4, model="other")  # the same model again: kept
    assert (recorder.layers, recorder.num_experts, recorder.model) == ((0, 1), 4, "tiny")
