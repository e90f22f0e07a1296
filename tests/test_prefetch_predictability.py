"""`benchmarks/prefetch_predictability.py`: the co-occurrence prefetch learns routing that is
predictable across layers (and then covers misses), counts its copies exactly, and refuses
a bad trace with one line and exit status 2."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import prefetch_predictability  # noqa: E402

from expertcache.trace.format import RoutingTrace  # noqa: E402


def predictable_trace(path: Path) -> Path:
    """3 requests x 40 tokens, 4 layers x 16 experts, top-2; layer l+1 chooses layer l's experts + 5."""
    rng = np.random.default_rng(0)
    first = np.stack([rng.choice(16, 2, replace=False) for _ in range(120)])
    ids = np.stack([(first + 5 * layer) % 16 for layer in range(4)], axis=1)
    trace = RoutingTrace(ids, forward_starts=np.arange(120), num_experts=16, request_starts=np.array([0, 40, 80]))
    trace.save(path)
    return path


def rows_of(tmp_path: Path, trace: Path) -> dict:
    out = tmp_path / "rows.csv"
    assert prefetch_predictability.main(["--trace", str(trace), "--csv", str(out)]) == 0
    return {(float(r["fraction"]), int(r["prefetch"])): r for r in csv.DictReader(open(out))}


def test_predictable_routing_is_prefetched_and_copies_are_counted(tmp_path):
    rows = rows_of(tmp_path, predictable_trace(tmp_path / "trace.npz"))
    for fraction in prefetch_predictability.FRACTIONS:
        base, two = rows[(fraction, 0)], rows[(fraction, 2)]
        assert float(base["prefetched_per_token"]) == 0 and float(base["copies_vs_no_prefetch"]) == 1
        assert float(two["prefetched_per_token"]) == 2 * 3  # P per layer after the first, every token
        assert float(two["misses_per_token"]) < 0.6 * float(base["misses_per_token"])
        assert float(two["covered_share"]) > 0.4


def test_a_bad_trace_exits_2_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        prefetch_predictability.main(["--trace", str(tmp_path / "missing.npz")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("prefetch_predictability:") and "\n" not in err
