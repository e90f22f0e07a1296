"""`benchmarks/profile_timeline.py`: where a profiled decode step's time goes, on hand-made
Chrome traces whose answer is known to the microsecond."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import BENCHMARKS, bench_module

timeline = bench_module("profile_timeline")

COPY = EMPTY = "_copy_experts_kernel"  # an empty launch is a copy kernel of ~2 us


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "ph": "X"}


def step_events() -> list[dict]:
    """Two copies of layer 0 (0-300, 330-600: one gap inside the layer), the chain to layer 1
    (apply tail to 605, dense, router, admission) and its copy (640-900), two layers with
    nothing to copy (an empty copy launch among them), layer 4's copy (1030-1200), the host's
    input copy of the next replay and the next step's first copy (1260-1400), a host gap of
    500 us, one last copy (1950-2000)."""
    return [
        kernel(COPY, 0, 300),
        kernel("_gate_up_kernel", 10, 200),  # hits, computed under the copy
        kernel(COPY, 330, 270),
        kernel("_down_kernel", 600, 5),  # the apply tail: to 605
        kernel("nvjet_dense", 606, 20),
        kernel("void (anonymous namespace)::softmax_warp_forward", 626, 2),
        kernel("_admit_small_kernel", 630, 5),  # 630-635
        kernel(COPY, 640, 260),
        kernel("_gate_up_kernel", 900, 10),  # tail to 910
        kernel("nvjet_dense", 910, 20),
        kernel("void (anonymous namespace)::softmax_warp_forward", 930, 2),  # layer 2
        kernel("_admit_small_kernel", 933, 3),
        kernel(EMPTY, 937, 2),  # nothing to copy: compute
        kernel("_gate_up_kernel", 940, 30),
        kernel("void (anonymous namespace)::softmax_warp_forward", 975, 2),  # layer 3
        kernel("_gate_up_kernel", 980, 30),
        kernel("void (anonymous namespace)::softmax_warp_forward", 1015, 2),  # layer 4
        kernel("_admit_small_kernel", 1020, 8),
        kernel(COPY, 1030, 170),
        kernel("_sum_over_k_kernel", 1200, 20),
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 1225, "dur": 1},
        kernel("void (anonymous namespace)::softmax_warp_forward", 1240, 2),
        kernel(COPY, 1260, 140),
        kernel(COPY, 1950, 50),  # after 550 us of nothing: the host
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # not a GPU event
    ]


def test_link_gaps_sort_each_gap_by_the_routers_in_it_and_leave_the_host_out():
    gaps, left_out = timeline.link_gaps(timeline.events_of(step_events()))
    assert [(g.us, g.routers, g.step_boundary) for g in gaps] == [
        (30, 0, False),  # inside layer 0's copies
        (40, 1, False),  # to layer 1's
        (130, 3, False),  # layers 2 and 3 had nothing to copy (the empty launch is no copy)
        (60, 1, True),  # the next replay's inputs
    ]
    chain = gaps[1]
    assert (chain.tail_us, chain.admission_us, chain.dense_us) == (5, 5, 30)
    assert left_out == 550  # the host's gap; nothing before the first copy or after the last


def test_spans_count_copy_compute_and_idle_time_without_the_host():
    totals, without_copies = timeline.spans(timeline.events_of(step_events()), replays=1)
    copying = 300 + 270 + 260 + 170 + 140 + 50
    assert totals["copy only"] + totals["both"] == copying
    assert totals["both"] == 200  # the hits' gate_up under layer 0's first copy
    assert totals["idle"] == 30 + 1 + 2 + 5 + 1 + 1 + 1 + 5 + 3 + 5 + 3 + 2 + 5 + 14 + 18  # between the kernels
    assert totals["compute only"] + totals["idle"] == pytest.approx(sum(without_copies.values()))
    assert sum(totals.values()) == 1400 + 50  # 0-1400 and the last copy; the 550 us host gap left out


def test_the_report_names_each_kind_of_gap_per_step():
    text = timeline.report(timeline.events_of(step_events()), replays=2)
    assert "inside a layer's copies: 0.5 gaps, 0.015 ms" in text
    assert "to the next layer's copies (apply tail, dense, router, admission): 0.5 gaps, 0.020 ms" in text
    assert "medians: apply tail 5.0 us, dense parts and router 30.0 us, admission 5.0 us" in text
    assert (
        "across layers with nothing to copy: 0.5 gaps, 0.065 ms (median 130.0 us, 1.0 layers, 0 across a step's end)"
        in text
    )
    assert "across a step's end (the last apply, the next replay's inputs, its first router): 0.5 gaps, 0.030" in text


def test_a_profile_without_copies_reports_no_link_gaps():
    events = timeline.events_of([kernel("nvjet_dense", 0, 20), kernel(EMPTY, 20, 2)])
    assert "link idles" not in timeline.report(events, replays=1)
    with pytest.raises(ValueError, match="no copy kernel"):
        timeline.link_gaps(events)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not a readable Chrome trace"),
        ('{"events": []}', "no traceEvents list"),
        ('{"traceEvents": [{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}', "saw no GPU events"),
    ],
)
def test_the_command_refuses_a_file_that_is_no_profile_in_one_line(tmp_path, content, message):
    path = tmp_path / "trace.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        timeline.load_events(path)
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "profile_timeline.py"), str(path)], capture_output=True, text=True
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and message in run.stderr


def test_the_command_reads_a_saved_trace(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": step_events()}))
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "profile_timeline.py"), str(path), "--replays", "1"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "across layers with nothing to copy: 1.0 gaps, 0.130 ms (median 130.0 us, 2.0 layers, 0 across" in run.stdout
    bad = subprocess.run(
        [sys.executable, str(BENCHMARKS / "profile_timeline.py"), str(path), "--replays", "0"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--replays must be at least 1" in bad.stderr and "Traceback" not in bad.stderr


def test_a_gzipped_trace_reads_like_the_plain_one(tmp_path):
    import gzip

    plain, packed = tmp_path / "trace.json", tmp_path / "trace.json.gz"
    plain.write_text(json.dumps({"traceEvents": step_events()}))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert timeline.load_events(packed) == timeline.load_events(plain)
    packed.write_bytes(b"\x1f\x8b broken")
    with pytest.raises(ValueError, match="not a readable Chrome trace"):
        timeline.load_events(packed)


def test_layers_with_nothing_to_copy_across_a_step_end_count_as_such():
    router = "void (anonymous namespace)::softmax_warp_forward"
    events = timeline.events_of(
        [
            kernel(COPY, 0, 100),
            kernel(router, 110, 2),  # a layer with nothing to copy, the step's last
            {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 150, "dur": 1},
            kernel(router, 170, 2),  # the next step's layer 0
            kernel(COPY, 180, 100),
        ]
    )
    (gap,), _ = timeline.link_gaps(events)
    assert (gap.us, gap.routers, gap.step_boundary) == (80, 2, True)
    text = timeline.report(events, replays=1)
    assert "across layers with nothing to copy: 1.0 gaps, 0.080 ms (median 80.0 us, 1.0 layers, 1 across" in text
    assert "its first router): 0.0 gaps" in text
