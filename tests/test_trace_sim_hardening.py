"""Hardening of the trace and simulator: misuse that used to corrupt a result silently.

* `RoutingRecorder` fed by two threads at once keeps each thread's forward passes whole;
* `RoutingTrace` cannot be changed after its constructor checked it;
* `replay` refuses a plain-list call of non-integer ids (NaN is not equal to itself);
* a global-pool replay of a trace whose rows are not aligned across layers warns.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import real_traces

from expertcache.policies import LRUPolicy
from expertcache.sim import ApproximateReplayWarning, replay, replay_trace, trace_calls
from expertcache.trace import RoutingRecorder, RoutingTrace, load_trace
from expertcache.trace.format import UNALIGNED_LAYERS

TRACES = real_traces()
MIXTRAL = TRACES / "mixtral-8x7b-instruct-fp8__speculative-moe"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="no real routing traces (../shared/traces)")

# --- RoutingRecorder: forwards of several threads at once -------------------------------------


def _record_in_lockstep(recorder: RoutingRecorder, ids: dict[str, list[int]], layers: int, rounds: int) -> None:
    """Each thread records ``rounds`` forwards of ``layers`` layers; a barrier after every layer
    makes the threads' records interleave (every thread is inside a forward at once)."""
    barrier = threading.Barrier(len(ids))
    failures: list[BaseException] = []

    def run(experts: list[int]) -> None:
        try:
            for _ in range(rounds):
                for layer in range(layers):
                    recorder.record(layer, np.array([experts]))
                    barrier.wait(10)
        except BaseException as error:  # a thread's failure must fail the test
            failures.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(experts,), name=name) for name, experts in ids.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not failures, failures


def test_forwards_of_threads_recording_at_once_stay_whole():
    ids = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}  # each thread routes its own experts
    layers, rounds = 4, 5
    recorder = RoutingRecorder(layers=range(layers), num_experts=8)
    _record_in_lockstep(recorder, ids, layers, rounds)
    trace = recorder.trace()
    assert trace.num_forwards == recorder.num_forwards == len(ids) * rounds
    assert trace.num_tokens == len(ids) * rounds  # one token a forward
    forwards = [trace.expert_ids[tokens].tolist() for tokens in trace.forward_slices()]
    # every forward holds one thread's ids at every layer (no -1, no mix of threads)
    expected = sorted(experts for experts in ids.values() for _ in range(rounds))
    assert sorted(forward[0][0] for forward in forwards) == expected
    for forward in forwards:
        assert forward == [[forward[0][0]] * layers], forward


def test_a_thread_s_request_and_forward_do_not_cut_another_thread_s_forward():
    recorder = RoutingRecorder(layers=[0, 1], num_experts=8)
    recorder.record(0, np.array([[1, 2]]))  # this thread's forward is open at layer 0

    def other() -> None:
        recorder.begin_request()
        recorder.record(0, np.array([[5, 6]]))
        recorder.record(1, np.array([[5, 6]]))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(10)
    recorder.record(1, np.array([[1, 2]]))  # ends this thread's first forward
    trace = recorder.trace()
    assert trace.expert_ids.tolist() == [[[1, 2], [1, 2]], [[5, 6], [5, 6]]]  # in the order they started
    assert trace.forward_starts.tolist() == [0, 1]
    assert trace.request_starts.tolist() == [1]  # the other thread's request, not this one's


def test_the_open_forward_of_a_finished_thread_is_kept_and_not_continued():
    recorder = RoutingRecorder(layers=[0, 1], num_experts=8)
    for experts in ([1, 2], [3, 4]):  # two threads one after the other, each one layer 0 record
        thread = threading.Thread(target=recorder.record, args=(0, np.array([experts])))
        thread.start()
        thread.join(10)
    recorder.record(1, np.array([[5, 6]]))  # a third thread's (this one's) own forward
    assert recorder.trace().expert_ids.tolist() == [[[1, 2], [-1, -1]], [[3, 4], [-1, -1]], [[-1, -1], [5, 6]]]


# --- RoutingTrace: no change after the constructor's checks ------------------------------------


def _small_trace() -> RoutingTrace:
    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]]])
    return RoutingTrace(ids, [0, 1], num_experts=4, model="m", request_starts=[0], layers=[3, 7], notes="n")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("num_experts", 2),  # below an id of the trace
        ("expert_ids", np.array([[[0, 0]]])),  # a repeated expert, and another token count
        ("forward_starts", np.array([5])),
        ("request_starts", np.array([1, 0])),
        ("layers", np.array([1])),
        ("model", 7),
        ("notes", "other"),  # even a valid value: the trace is a value, make a new one
    ],
)
def test_assigning_a_trace_field_is_refused_and_changes_nothing(name, value):
    trace = _small_trace()
    before = {field.name: np.copy(getattr(trace, field.name)) for field in dataclasses.fields(trace)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(trace, name, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(trace, name)
    for field, kept in before.items():
        np.testing.assert_array_equal(getattr(trace, field), kept)


@pytest.mark.parametrize("name", ["expert_ids", "forward_starts", "request_starts", "layers"])
def test_writing_into_a_trace_array_is_refused_and_changes_nothing(name):
    trace = _small_trace()
    array = getattr(trace, name)
    kept = array.copy()
    with pytest.raises(ValueError, match="read-only"):
        array[0] = 3 if name != "expert_ids" else 7  # an id out of range / a start off the grid
    np.testing.assert_array_equal(getattr(trace, name), kept)


def test_a_trace_owns_its_arrays_and_replace_checks_the_new_fields():
    ids = np.array([[[0, 1]], [[1, 2]]], dtype=np.int16)
    trace = RoutingTrace(ids, [0, 1], num_experts=4)
    ids[0, 0, 0] = 1  # the caller's array: the trace holds a copy
    assert trace.expert_ids.tolist() == [[[0, 1]], [[1, 2]]]
    assert dataclasses.replace(trace, notes="later").notes == "later"  # a new trace, the way to change one
    with pytest.raises(ValueError, match="expert_ids repeats expert 1"):
        dataclasses.replace(trace, expert_ids=np.array([[[1, 1]], [[1, 2]]]))
    assert dataclasses.replace(trace, num_experts=3).expert_ids.flags.writeable is False


# --- replay: plain-list calls hold integer ids ------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        [1, float("nan"), float("nan")],  # NaN != NaN: each one was a new key (2 misses for one id)
        [1.0, 2.0],  # whole floats: still not ids
        [np.float32(1.5)],
        [True, False],  # a mask, not ids
        [np.bool_(True)],
        [1 + 0j],
        [Fraction(1, 2)],
        [torch.tensor(1), torch.tensor(1)],  # 0-d tensors hash by identity: two keys for one id
        [(0, float("nan"))],  # a (layer, expert) key of a shared pool
    ],
)
def test_a_list_call_of_ids_that_are_not_integers_is_refused_naming_it(call):
    policy = LRUPolicy(capacity=4)
    with pytest.raises(TypeError, match=r"call 1 holds .* key .*; expert ids are integers"):
        replay([[0, 1], call], policy=policy, capacity=4)
    assert replay([[0, 1], [1, 2]], policy=policy, capacity=4).misses == 3  # the policy is still free


def test_list_calls_of_integer_keys_still_replay():
    calls = [[np.int64(1), 2], [1, np.int32(2)], [(0, 1), (1, 1)], [(0, np.int16(1))], ["a", "a"]]
    result = replay(calls, policy="lru", capacity=4)
    assert (result.hits, result.misses) == (3, 5)


# --- trace_calls(scope="global"): a trace whose rows are not aligned across layers -------------


def _decode_file(path) -> None:
    """A decode-only Mixtral-style file: layer 1 lost its first token's record, so its rows
    are shifted against layer 0's (token_idx is renumbered per layer after a loss)."""
    rows = [(0, 0, [0, 1]), (0, 1, [2, 3]), (1, 0, [4, 5])]  # (layer, token_idx, experts)
    lines = [{"dataset": "d", "problem_id": 0, "layer": layer, "experts": experts, "token_idx": token}
             for layer, token, experts in rows]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_global_replay_of_rows_not_aligned_across_layers_warns(tmp_path):
    _decode_file(tmp_path / "d.jsonl")
    trace = load_trace(tmp_path / "d.jsonl")
    assert not trace.layers_aligned
    with pytest.warns(ApproximateReplayWarning, match=r"not aligned across layers.*approximate.*scope='layer'") as got:
        trace_calls(trace, scope="global")
    saved = load_trace(trace.save(tmp_path / "d.npz"))  # the notes travel with the trace
    with pytest.warns(ApproximateReplayWarning, match="d.jsonl") as again:
        replay_trace(saved, policy="lru", capacity=4, scope="global")
    assert {got[0].filename, again[0].filename} == {__file__}  # the warning points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(trace_calls(trace, scope="layer")) == 2  # per layer: exact, no warning
        trace_calls(_small_trace(), scope="global")  # aligned rows: exact, no warning


def test_a_global_replay_of_one_unaligned_layer_is_exact_and_does_not_warn(tmp_path):
    ids = np.array([[[0, 1]], [[1, 2]]])
    trace = RoutingTrace(ids, [0, 1], num_experts=4, notes=f"Rows {UNALIGNED_LAYERS}.")
    assert not trace.layers_aligned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace_calls(trace, scope="global")  # one layer: the global pool is the layer's pool


@needs_traces
@pytest.mark.parametrize("name", ["humaneval_2_routing.jsonl", "gsm8k_2_routing.jsonl"])
def test_global_replays_of_the_mixtral_decode_files_warn(name):
    trace = load_trace(MIXTRAL / name)
    with pytest.warns(ApproximateReplayWarning, match=name):
        trace_calls(trace, scope="global")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace_calls(trace, scope="layer")


@needs_traces
def test_a_global_replay_of_the_mixtral_raw_log_does_not_warn():
    trace = load_trace(MIXTRAL / "routing_raw.jsonl")  # lost records are -1 at their exact place
    assert trace.layers_aligned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace_calls(trace, scope="global")
