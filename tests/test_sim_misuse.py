"""Misuse of the planner and the trace loaders that gave a wrong answer instead of an error.

Each case is something a user can do by accident:

* ``expertcache plan --trace FOLDER`` on a folder holding the saved traces of two models (64
  and 128 experts per layer): refused, naming the folder and the files, instead of one trace
  of the first model's name with the larger expert count;
* a saved trace whose ``format_version`` is ``true`` or ``1.0`` (not the integer 1): refused
  as an unsupported version, as any other wrong version is;
* ``plan``'s table marks the GPU budget's size with ``*``: only the per-layer row of the
  budget's per-layer size and the global row of its global size, never a per-layer row
  whose size happens to equal the global one.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest

from expertcache.cli import main
from expertcache.commands.plan_report import format_table
from expertcache.planner import plan
from expertcache.trace import RoutingTrace, load_trace
from expertcache.trace.errors import TraceFileError


def _small_trace(num_experts: int, model: str) -> RoutingTrace:
    ids = np.array([[[0, 1]], [[2, 3]], [[0, 2]]])
    return RoutingTrace(ids, np.arange(3), num_experts=num_experts, model=model)


def test_a_folder_of_two_models_traces_is_refused_in_one_line(tmp_path, capsys):
    _small_trace(64, "model-a").save(tmp_path / "a.npz")
    _small_trace(128, "model-b").save(tmp_path / "b.npz")
    with pytest.raises(TraceFileError, match=re.escape(str(tmp_path)) + ": .*model-a.*model-b"):
        load_trace(tmp_path)
    status = main(["plan", "--trace", str(tmp_path), "--expert-bytes", "10", "--gpu-budget", "1e-6", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "a.npz" in err and "b.npz" in err


def test_a_folder_of_saved_traces_stating_different_expert_counts_is_refused(tmp_path):
    _small_trace(64, "same").save(tmp_path / "a.npz")
    _small_trace(128, "same").save(tmp_path / "b.npz")
    with pytest.raises(TraceFileError, match=re.escape(str(tmp_path)) + ": .*experts per layer.*64.*128"):
        load_trace(tmp_path)
    _small_trace(64, "same").save(tmp_path / "b.npz")  # the same model's: one trace
    trace = load_trace(tmp_path)
    assert (trace.num_tokens, trace.num_experts, trace.model) == (6, 64, "same")


@pytest.mark.parametrize("version", [True, 1.0])
def test_a_format_version_that_is_not_the_integer_is_refused(tmp_path, version):
    trace = _small_trace(8, "m")
    meta = {"format_version": version, "num_experts": 8, "model": "m", "source": "", "notes": ""}
    archive = io.BytesIO()
    np.savez(
        archive,
        expert_ids=trace.expert_ids,
        forward_starts=trace.forward_starts,
        request_starts=trace.request_starts,
        layers=np.asarray(trace.layers),
        meta=np.array(json.dumps(meta)),
    )
    path = tmp_path / "t.npz"
    path.write_bytes(archive.getvalue())
    with pytest.raises(TraceFileError, match=re.escape(str(path)) + ": unsupported trace format"):
        load_trace(path)


def test_the_budget_marker_is_on_the_budgets_rows_only():
    # E=8, L=2, top-2; 4 slots buy 2 per layer, so the global pool has 4: a per-layer size too
    generator = np.random.default_rng(0)
    ids = np.stack([[generator.choice(8, 2, replace=False) for _ in range(2)] for _ in range(40)])
    trace = RoutingTrace(ids, np.arange(40), num_experts=8)
    result = plan(trace, expert_bytes=1, gpu_budget_bytes=4, policies=["lru"])
    assert (result.layer_cache_size, result.global_slots) == (2, 4)
    marked = [line.split()[:2] for line in format_table(result, ["lru"]).splitlines() if re.search(r"\d\*", line)]
    assert marked == [["layer", "2"], ["global", "4"]]
