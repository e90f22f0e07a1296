"""Odd inputs to the simulator, the trace format and recorder, and the planner.

Each case is a call an ordinary user could make: tensor calls, numpy counts, a generator of
policy names, a recorder described after it recorded. Each must give the right answer or a
clear error at the call that was wrong, never a wrong count or a failure later on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_plan import _trace

from expertcache.planner import plan
from expertcache.sim import replay
from expertcache.trace import RoutingRecorder, RoutingTrace

# --- replay: calls given as arrays or tensors -------------------------------------------------


def test_tensor_calls_count_ids_by_value():
    # a tensor's elements are 0-d tensors, hashed by identity: [1, 2] then [1, 2] hit nothing
    as_lists = replay([[1, 2], [1, 2]], policy="lru", capacity=2)
    as_tensors = replay([torch.tensor([1, 2]), torch.tensor([1, 2])], policy="lru", capacity=2)
    as_arrays = replay([np.array([1, 2]), np.array([1, 2])], policy="lru", capacity=2)
    assert (as_lists.hits, as_lists.misses) == (2, 2)
    assert as_tensors == as_lists
    assert as_arrays == as_lists
    assert replay(torch.tensor([[1, 2], [1, 2]]), policy="belady", capacity=2) == as_lists  # rows are calls


@pytest.mark.parametrize(
    "call",
    [
        torch.tensor([[1, 2], [3, 4]]),  # [T, K] ids of one call: rows would be keys
        np.array([[1, 2], [3, 4]]),
        torch.tensor(3),  # 0-d: not a sequence
        np.array(3),
    ],
)
def test_a_call_that_is_not_a_1d_array_is_refused_naming_it(call):
    with pytest.raises(TypeError, match=r"call 0 must be a 1-D sequence of keys, got a [02]-D"):
        replay([call], policy="lru", capacity=4)


def test_num_ids_refuses_bools():
    kwargs = {"policy": "lru", "capacity": 2, "oversize": "overlapped", "overlap_max_ids": 4}
    assert replay([[0]], num_ids=[np.int64(1)], **kwargs).misses == 1  # a numpy count is a count
    with pytest.raises(TypeError, match=r"num_ids\[0\] must be an int"):
        replay([[0]], num_ids=[True], **kwargs)


# --- RoutingTrace.load: the num_experts argument is the caller's, not the file's ---------------


@pytest.mark.parametrize(("num_experts", "error"), [(0, ValueError), (True, TypeError), (4.0, TypeError)])
def test_load_blames_a_bad_num_experts_argument_not_the_file(tmp_path, num_experts, error):
    path = RoutingTrace(np.array([[[0, 1]]]), [0], num_experts=4).save(tmp_path / "t.npz")
    assert RoutingTrace.load(path, num_experts=np.int64(8)).num_experts == 8
    with pytest.raises(error, match="num_experts must be") as raised:
        RoutingTrace.load(path, num_experts=num_experts)
    assert "not a valid routing trace" not in str(raised.value)


# --- RoutingRecorder --------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [True, 1.0])  # bool and float pass `layer in layers`
def test_record_refuses_a_layer_that_is_not_an_int(layer):
    recorder = RoutingRecorder(layers=[0, 1], num_experts=8)
    with pytest.raises(TypeError, match="layer must be an int"):
        recorder.record(layer, np.array([[1, 2]]))
    assert recorder.num_forwards == 0
    recorder.record(np.int64(1), np.array([[1, 2]]))  # a numpy int is a layer index
    assert recorder.trace().expert_ids.tolist() == [[[-1, -1], [1, 2]]]


def test_record_refuses_topk_ids_without_a_column():
    recorder = RoutingRecorder(layers=[0], num_experts=8)
    with pytest.raises(ValueError, match=r"topk_ids must have at least one id per token \(K >= 1\), got shape"):
        recorder.record(0, np.zeros((1, 0), dtype=np.int64))
    assert recorder.num_forwards == 0


def test_a_request_whose_forward_routed_no_token_still_makes_a_trace():
    recorder = RoutingRecorder(layers=[0], num_experts=8)
    recorder.record(0, np.array([[1, 2]]))
    recorder.begin_request()
    recorder.record(0, np.zeros((0, 2), dtype=np.int64))  # a forward pass of no token
    trace = recorder.trace()
    assert trace.expert_ids.tolist() == [[[1, 2]]] and trace.request_starts.tolist() == []
    recorder.record(0, np.array([[3, 4]]))  # the request's tokens come in the next pass
    assert recorder.trace().request_starts.tolist() == [1]


def test_describe_refuses_fewer_experts_than_the_ids_already_recorded():
    recorder = RoutingRecorder(layers=[0])
    recorder.record(0, np.array([[5, 6]]))
    with pytest.raises(ValueError, match=r"already recorded expert id 6; the model has 4 experts"):
        recorder.describe(layers=[0], num_experts=4)
    assert recorder.num_experts is None  # nothing changed
    recorder.describe(layers=[0], num_experts=7)
    assert recorder.trace().expert_ids.tolist() == [[[5, 6]]]


def test_describe_refuses_a_model_name_that_is_not_a_str():
    recorder = RoutingRecorder()
    with pytest.raises(TypeError, match="model must be a str"):
        recorder.describe(layers=[0], num_experts=4, model=5)  # type: ignore[arg-type]
    assert recorder.layers is None and recorder.num_experts is None


# --- plan -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace() -> RoutingTrace:
    return _trace(tokens=20)


def _sizes(result) -> list[int]:
    return sorted({row.slots for row in result.rows if row.scope == "layer"})


def test_plan_takes_numpy_integers_as_counts(trace):
    plain = plan(trace, expert_bytes=1000, gpu_budget_bytes=8000, model_layers=4, copy_bytes=500, policies=["lru"])
    numpy = plan(
        trace,
        expert_bytes=np.int64(1000),
        gpu_budget_bytes=np.int64(8000),
        model_layers=np.int32(4),
        copy_bytes=np.int64(500),
        policies=["lru"],
    )
    assert numpy == plain
    assert type(numpy.budget_slots) is int


def test_plan_reads_a_generator_of_policies_once(trace):
    result = plan(trace, expert_bytes=1000, gpu_budget_bytes=8000, policies=(name for name in ["lru", "arc"]))
    assert {row.policy for row in result.rows} == {"lru", "arc", "belady", "unbounded"}


def test_plan_takes_any_real_fraction_and_refuses_a_str(trace):
    kwargs = {"expert_bytes": 1000, "gpu_budget_bytes": 8000, "policies": ["lru"]}
    assert _sizes(plan(trace, fractions=[np.float32(0.25)], **kwargs)) == [2, 4]  # 0.25 x 8, and the budget's 4
    with pytest.raises(TypeError, match="fractions must be a sequence of numbers, got '0.5'"):
        plan(trace, fractions="0.5", **kwargs)  # type: ignore[arg-type]


def test_plan_refuses_a_bool_min_gain(trace):
    with pytest.raises(ValueError, match="min_gain must be a non-negative number, got True"):
        plan(trace, expert_bytes=1000, gpu_budget_bytes=8000, policies=["lru"], min_gain=True)


# --- a record that names an expert twice; layer_of with one layer -------------------------------


def test_a_trace_record_naming_an_expert_twice_is_refused_naming_it():
    ids = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 6]]])  # token 1, layer column 1: expert 6 twice
    with pytest.raises(ValueError, match="repeats expert 6 in the record of token 1 at layer column 1"):
        RoutingTrace(ids, [0], num_experts=8)
    unlogged = np.array([[[-1, -1], [2, 3]]])  # ids not logged (-1) may repeat
    assert RoutingTrace(unlogged, [0], num_experts=8).num_records == 1


def test_the_recorder_refuses_a_call_naming_an_expert_twice_and_records_nothing():
    recorder = RoutingRecorder(layers=[0], num_experts=8)
    with pytest.raises(ValueError, match="token 1 of the call names expert 3 twice"):
        recorder.record(0, torch.tensor([[0, 1], [3, 3]]))
    recorder.record(0, torch.tensor([[0, 1], [3, 4]]))
    assert recorder.trace().expert_ids.tolist() == [[[0, 1]], [[3, 4]]]


def test_layer_of_is_checked_in_a_replay_of_one_layer():
    # it was ignored: keys of "layer 1" ran in a one-layer pool without a word
    with pytest.raises(ValueError, match=r"call 0: layer_of gave 1, not a layer in \[0, 1\)"):
        replay([[1, 2]], policy="lru", capacity=2, num_layers=1, layer_of=lambda key: 1)
    honoured = replay([[1, 2], [1, 3]], policy="lru", capacity=2, num_layers=1, layer_of=lambda key: 0)
    assert honoured == replay([[1, 2], [1, 3]], policy="lru", capacity=2)
