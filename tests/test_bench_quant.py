"""benchmarks/bench_quant.py: its routing fold, and its ``--dry-run`` (tiny shapes, CPU, interpreted).

The dry run goes through every section and kind of variant the GPU run measures (resident,
per-layer and global pools, the RFC budget, both formats through the same kernels and the torch
GPT-OSS MLP, DeepSeek's two applies); its CSV rows (in a temporary folder) are checked here, not its timings.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import BENCHMARKS, bench_module


def _has_traces() -> bool:
    try:
        bench_module("_common").traces_dir()
    except FileNotFoundError:
        return False
    return True


@pytest.mark.parametrize(
    "row, expected",
    [
        ([2, 34, 66, 3, 35, 5, 7, 9], [2, 3, 5, 7]),  # duplicates mod 32 dropped, router order kept
        ([1, 33, 65, 97, 1, 33, 65, 97], [1, 2, 3, 4]),  # one distinct id: fillers first + 1, + 2, + 3
        ([31, 63, 95, 127, 31, 63, 95, 127], [31, 0, 1, 2]),  # fillers wrap round mod 32
        ([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3]),  # already distinct: the first four
    ],
)
def test_fold_routing_takes_the_first_distinct_ids(row, expected):
    fold = bench_module("bench_quant").fold_routing
    folded = fold(np.asarray(row, dtype=np.int64).reshape(1, 1, 8), 32, 4)
    assert folded.shape == (1, 1, 4) and folded.reshape(-1).tolist() == expected


def test_uniform_routing_is_distinct_and_seeded():
    uniform = bench_module("bench_quant").uniform_routing
    ids = uniform(50, 3, 32, 4)
    assert ids.shape == (50, 3, 4) and ids.min() >= 0 and ids.max() < 32
    assert all(len(set(row)) == 4 for row in ids.reshape(-1, 4).tolist())
    assert np.array_equal(ids, uniform(50, 3, 32, 4))


def test_bench_quant_dry_run():
    before = sorted((BENCHMARKS / "results").glob("*.csv"), key=str)
    stamps = [path.stat().st_mtime_ns for path in before]
    command = [sys.executable, str(BENCHMARKS / "bench_quant.py"), "--dry-run"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bit for bit: True" in done.stdout and "tinyserve" in done.stdout
    path = Path(re.search(r"^CSV: (.+)$", done.stdout, re.MULTILINE).group(1))
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["error"] for row in rows if row.get("error")] == []
    assert {row["section"] for row in rows} == {"gpt-oss", "deepseek"}
    assert {row["routing"] for row in rows} == ({"trace", "uniform"} if _has_traces() else {"uniform"})
    oss = [row for row in rows if row["section"] == "gpt-oss"]
    assert {(row["format"], row["pool"]) for row in oss} == {
        (fmt, pool) for fmt in ("mxfp4", "float16") for pool in ("resident", "per layer", "global")
    }
    assert any("RFC" in row["budget"] for row in oss)
    for row in rows:
        if row["pool"] != "resident":
            assert float(row["rel_err"]) == 0.0  # the cache serves the resident experts' bytes
            assert float(row["bound_serial_ms"]) >= float(row["bound_max_ms"]) > 0
    # equal GPU bytes: the 16-bit format gets fewer slots at every budget, never more bytes
    slots = {(r["routing"], r["pool"], r["budget"], r["format"]): r for r in oss if r["pool"] != "resident"}
    for (routing, pool, budget, fmt), row in slots.items():
        if fmt == "mxfp4":
            dense = slots[(routing, pool, budget, "float16")]
            assert int(dense["slots"]) < int(row["slots"]) and float(dense["pool_gb"]) <= float(row["pool_gb"])
    # both GPT-OSS formats run the same kernels (the 16-bit one as format "none")
    assert {row["apply"] for row in oss if row["pool"] != "resident"} == {"moe_apply_quant_passes"}
    # the same MLP in another format or apply: close to the section's first resident row
    resident = [r for r in rows if r["pool"] == "resident"]
    cross = [r for r in resident if (r["format"], r["apply"]) not in {("mxfp4", "moe_apply_quant_passes"),
                                                                        ("fp8", "moe_apply_quant_passes")}]  # fmt: skip
    assert {(r["format"], r["apply"]) for r in cross} == {
        ("float16", "moe_apply_quant_passes"), ("float16", "gpt_oss_apply_torch"), ("fp8", "moe_apply_passes (old)")
    }  # fmt: skip
    assert all(float(r["rel_err"]) < 1e-2 for r in cross)
    # MXFP4 and its exact 16-bit copy through one kernel: equal within fp32 rounding (fp32 tokens)
    assert all(float(r["rel_err"]) < 1e-4 for r in cross if r["apply"] == "moe_apply_quant_passes")
    assert [path.stat().st_mtime_ns for path in before] == stamps  # a dry run writes no CSV among the results
