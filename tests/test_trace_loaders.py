"""Trace loaders on the real traces in ``../shared/traces`` (skipped when it is absent).

Every expected count below is stated in ``shared/traces/README.md``; the loaders must
reproduce it, and must survive a save/load round trip through the one trace format.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import real_traces

from expertcache.trace import RoutingTrace, detect_format, load_trace

TRACES = real_traces()
MIXTRAL = TRACES / "mixtral-8x7b-instruct-fp8__speculative-moe"
QWEN15 = TRACES / "qwen1.5-moe-a2.7b-chat-gptq-int4__vllm-expert-profiler" / "moe_routes.jsonl"
OLMOE = TRACES / "olmoe-1b-7b-0924__cerebras-assesment2" / "moe_routes.jsonl"
QWEN3 = TRACES / "qwen3-30b-a3b-instruct-2507__local-moe-inference-stack"

needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="no real routing traces (../shared/traces)")


def _records(trace: RoutingTrace) -> int:
    return int((trace.expert_ids >= 0).all(axis=2).sum())


@needs_traces
def test_mixtral_raw_log_prefill_then_decode():
    trace = load_trace(MIXTRAL / "routing_raw.jsonl")
    assert trace.expert_ids.shape == (135 + 83, 32, 2)
    assert trace.num_experts == 8
    assert trace.forward_starts.tolist() == [0, *range(135, 135 + 83)]
    present = (trace.expert_ids >= 0).all(axis=2)
    assert int(present[:135].sum()) == 4198  # README: prefill 4,198 of 4,320
    assert int(present[135:].sum()) == 2579  # decode 2,579 of 2,656
    assert int(present[135:].all(axis=1).sum()) == 35  # 35 of 83 steps have all 32 layers
    assert "0.5, 0.5" in trace.notes


@needs_traces
@pytest.mark.parametrize(
    ("name", "records", "per_problem"),
    [("humaneval_2_routing.jsonl", 10779, [83, 255]), ("gsm8k_2_routing.jsonl", 7889, [168, 79])],
)
def test_mixtral_decode_only_files(name, records, per_problem):
    trace = load_trace(MIXTRAL / name)
    assert _records(trace) == records
    assert trace.num_tokens == sum(per_problem)  # longest layer of each problem
    assert trace.request_starts.tolist() == [0, per_problem[0]]
    assert trace.num_forwards == trace.num_tokens  # one decode token per forward
    assert "NOT aligned across layers" in trace.notes


@needs_traces
def test_qwen15_profiler_drops_warm_up_batches():
    trace = load_trace(QWEN15)
    assert trace.expert_ids.shape == (4384, 1, 4)
    assert trace.num_forwards == 129  # batches 3..131
    sizes = np.diff(np.append(trace.forward_starts, trace.num_tokens))
    assert sizes[:2].tolist() == [65, 1406]
    assert 15 <= sizes[2:].min() and sizes[2:].max() <= 25
    assert trace.num_experts == 60 and trace.layers.tolist() == [0]
    assert "Dropped 16640" in trace.notes  # batches 0-2: 8,192 + 8,192 + 256 rows


@needs_traces
def test_olmoe_drops_the_2048_dummy_rows_and_has_no_batches():
    trace = load_trace(OLMOE)
    assert trace.expert_ids.shape == (4471, 1, 8)
    assert trace.num_forwards == 4471
    assert trace.num_experts == 64
    assert "Dropped 2048" in trace.notes


@needs_traces
def test_qwen3_windows_load_as_one_trace_of_48_layers():
    trace = load_trace(QWEN3)
    assert trace.expert_ids.shape == (297, 48, 8)
    assert _records(trace) == 14256
    assert trace.num_experts == 128
    # each window starts a request; window 3 switches prompt after 3 tokens
    assert trace.request_starts.tolist() == [0, 75, 147, 222, 225]
    window = load_trace(QWEN3 / "window_3.jsonl")
    assert window.request_starts.tolist() == [0, 3]
    np.testing.assert_array_equal(window.expert_ids, trace.expert_ids[222:])


@needs_traces
def test_every_routing_file_round_trips_through_npz(tmp_path):
    files = sorted(TRACES.rglob("*.jsonl"))
    routing = [file for file in files if detect_format(file) is not None]
    assert len(routing) == 9  # outputs files are not routing traces
    for file in routing:
        trace = load_trace(file)
        trace.save(tmp_path / "t.npz")
        again = load_trace(tmp_path / "t.npz")
        np.testing.assert_array_equal(again.expert_ids, trace.expert_ids)
        np.testing.assert_array_equal(again.forward_starts, trace.forward_starts)
        assert again.notes == trace.notes


@needs_traces
def test_a_folder_mixing_formats_is_refused():
    with pytest.raises(ValueError, match="mixes trace formats"):
        load_trace(MIXTRAL)


def test_route_log_with_two_layers_and_batches(tmp_path):
    """Synthetic: one dummy batch, then two forwards over layers 0 and 3."""
    lines = [{"type": "meta", "model_id": "m", "top_k": 2, "num_experts": 6}]

    def call(layer, rows):
        for index, ids in enumerate(rows):
            lines.append({"type": "route", "token_idx": index, "layer": layer, "topk_ids": ids})

    call(0, [[1, 2]] * 70)  # profiling dummy: one repeated row
    call(0, [[0, 1], [2, 3]])
    call(3, [[4, 5], [0, 5]])
    call(0, [[1, 4]])
    call(3, [[2, 3]])
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    trace = load_trace(path)
    assert trace.layers.tolist() == [0, 3]
    assert trace.forward_starts.tolist() == [0, 2]
    assert trace.expert_ids.tolist() == [
        [[0, 1], [4, 5]],
        [[2, 3], [0, 5]],
        [[1, 4], [2, 3]],
    ]
    assert "Dropped 70" in trace.notes


def test_unknown_file_is_refused(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not a routing trace"):
        load_trace(path)


@needs_traces
@pytest.mark.parametrize(
    "source",
    [QWEN15, OLMOE, MIXTRAL / "routing_raw.jsonl", MIXTRAL / "gsm8k_2_routing.jsonl"],
    ids=["route_log", "layer_records", "raw_routing_log", "decode_routing"],
)
def test_a_byte_order_mark_opening_a_jsonl_file_is_read_past(tmp_path, source):
    """Some editors save UTF-8 with a BOM; it opened the first line, so the file was refused
    as "not a routing trace" while listing exactly the fields that were expected."""
    head = source.read_bytes()  # whole files (1-4 MB): the first thousands of rows can be dummies
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_bytes(head)
    marked.write_bytes(b"\xef\xbb\xbf" + head)
    expected, got = load_trace(plain), load_trace(marked)
    assert detect_format(marked) == detect_format(plain)
    assert got.expert_ids.tolist() == expected.expert_ids.tolist()
    assert got.forward_starts.tolist() == expected.forward_starts.tolist()
