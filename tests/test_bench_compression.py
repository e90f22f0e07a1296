"""`benchmarks/bench_compression.py` runs end to end on a CPU (``--dry-run``: tiny shapes,
interpreted kernels, CSVs to a temporary folder), and its checks catch what they claim to:
a wrong slot byte, the entropy bound of known exponent mixes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from helpers import traces_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_compression  # noqa: E402


def test_dry_run_prints_every_part_and_checks_every_variant():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_compression.py"), "--dry-run", "--skip-families"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for title in ("(a) coded / raw bytes", "(b) tiny (dry run) bursts", "(c) one w1 tensor"):
        assert title in out
    copy_lines = [line for line in out.splitlines() if "copy engine, raw" in line or "decode copy, coded" in line]
    assert len(copy_lines) == 2 + 2 * 2 and all(line.rstrip().endswith("True") for line in copy_lines)
    assert "bench_compression_dry_" in out  # the CSVs went to a temporary folder, not results/


def test_the_slot_check_sees_one_wrong_byte():
    weights = {"w1": (torch.randn(4, 3, 8) * 0.02).to(torch.bfloat16)}
    slots = {"w1": torch.empty(3, 3, 8, dtype=torch.bfloat16)}
    burst = bench_compression.Burst(2, weights, slots, torch.device("cpu"), torch.Generator().manual_seed(0))
    burst.reset()
    assert not burst.exact()  # nothing copied yet
    slots["w1"][burst.slot_ids] = weights["w1"][burst.experts]
    assert burst.exact()
    slots["w1"].view(torch.uint8).view(-1)[int(burst.slot_ids[1]) * 48 + 5] ^= 1
    assert not burst.exact()
    slots["w1"].view(torch.uint8).view(-1)[int(burst.slot_ids[1]) * 48 + 5] ^= 1
    spare = ({0, 1, 2} - set(burst.slot_ids.tolist())).pop()
    slots["w1"][spare, 0, 0] = 1.0  # an unplanned slot written
    assert not burst.exact()


def test_the_entropy_bound_of_known_mixes():
    ones = torch.ones(64, dtype=torch.bfloat16)  # one exponent: 0 bits
    assert bench_compression.exponent_entropy_bound(ones) == 0.5
    halves = torch.tensor([1.0, -0.5] * 32, dtype=torch.bfloat16)  # two exponents, equally often: 1 bit
    assert bench_compression.exponent_entropy_bound(halves) == 9 / 16
    fp16 = torch.tensor([1.0, 2.0, 4.0, 8.0] * 8, dtype=torch.float16)  # 6-bit literal + 2 bits
    assert bench_compression.exponent_entropy_bound(fp16) == (11 + 2) / 16


def _run_bench(*arguments: str) -> subprocess.CompletedProcess:
    env = {**traces_env(tempfile.mkdtemp(prefix="traces_")), "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


def test_decode_benchmark_compares_raw_and_coded_stores_on_a_cpu():
    """One layer, 3 trace tokens, 8 and 32 slots: misses are served from both stores alike."""
    done = _run_bench("--compression", "exponent", "--dry-run", "--layers", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if " exponent " in f" {line} " and "%" in line]
    assert len(rows) == 2 and all(row[-1] == "True" for row in rows)  # slots_equal_raw
    assert "bench_decode_dry_" in done.stdout
    refused = _run_bench("--dry-run")
    assert refused.returncode == 2 and "--dry-run runs the --compression exponent comparison" in refused.stderr
