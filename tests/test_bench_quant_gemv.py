"""benchmarks/bench_quant_gemv.py: its tiles, its rows and bounds (tiny shapes, timing stubbed), its bad flags.

The sweep itself needs a GPU; here each row's launch runs once (interpreted on a CPU) in place
of the graphed timing, so the rows, their byte counts and bounds, and the kernels' outputs
at every tile tried are checked.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import devices
from helpers import bench_module

from expertcache.kernels import moe_apply_quant_torch
from expertcache.kernels.quant_apply import DOWN_TILES, GATE_UP_TILES, SMALL_CALL_GATE_UP_TILES, Tile


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench_quant_gemv")


def test_the_sweep_tries_the_library_tiles_and_the_old_one(bench):
    for quick in (True, False):
        plain, pieces = set(bench.tiles(quick, pieces=False)), set(bench.tiles(quick, pieces=True))
        library = {tile for table in (GATE_UP_TILES, SMALL_CALL_GATE_UP_TILES, DOWN_TILES) for tile in table.values()}
        assert library <= pieces and {tile for tile in library if tile.chunks == 1} <= plain
        assert Tile(16, 256, 4, False) in plain
        assert all(tile.chunks == 1 for tile in plain)  # MXFP4 takes no pieces
        assert plain < pieces and any(tile.chunks > 1 for tile in pieces - plain)
    assert bench.tile_name(Tile(16, 128, 8, True, chunks=4)) == "16x128x4 w8 once"
    assert bench.tile_name(Tile(16, 256, 4, False)) == "16x256 w4 per step"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("label", ["fp8 qwen3", "mxfp4 gpt-oss", "bf16 gpt-oss"])
def test_rows_count_the_distinct_experts_bytes(bench, monkeypatch, device, label):
    launches = []
    monkeypatch.setattr(bench, "graphed_us", lambda calls: launches.append(calls[0]() or 1) or 2.0)
    monkeypatch.setattr(bench, "CALLS", 2)
    shape = dict(bench.FORMATS[label], experts=4, hidden=64, inter=32, top_k=2)
    tensors = bench.experts_of(shape, torch.device(device))
    candidates = bench.tiles(True, pieces=label != "mxfp4 gpt-oss")
    rows = bench.rows_for(label, shape, tensors, 3, 1000.0, candidates)
    assert len(rows) == len(launches) == 2 + 2 * len(candidates)
    assert [row["variant"] for row in rows[:2]] == ["moe_apply_quant_passes gemv", "moe_apply_quant_passes grouped"]
    w1, w2 = bench.expert_bytes(tensors, "w1"), bench.expert_bytes(tensors, "w2")
    # one expert's gate/up rows (2I = 64 of H = 64) and down rows (H = 64 of I = 32), by format
    expected = {
        "fp8 qwen3": (64 * 64 + 4, 64 * 32 + 4),  # e4m3 + one fp32 128x128 block scale
        "mxfp4 gpt-oss": (64 * 2 * 16 + 64 * 2 + 64 * 4, 64 * 1 * 16 + 64 * 1 + 64 * 4),  # blocks, e8m0, bias
        "bf16 gpt-oss": (64 * 64 * 2 + 64 * 4, 64 * 32 * 2 + 64 * 4),  # weights + fp32 biases
    }
    assert (w1, w2) == expected[label]
    for row in rows:
        assert row["us"] == 2.0 and row["ratio"] == pytest.approx(2.0 / row["bound_us"])
        nbytes = {"gate_up": w1, "down": w2}.get(row["variant"], w1 + w2)
        distinct = row["bound_us"] * 1000.0 * 1e3 / nbytes  # bound = distinct experts' bytes / HBM rate
        assert 2 - 1e-9 <= distinct <= 4 + 1e-9 and distinct * 2 == pytest.approx(
            round(distinct * 2)
        )  # a mean over 2 calls


@pytest.mark.parametrize("device", devices())
def test_the_swept_kernels_compute_the_mlp(bench, device):
    """The benchmark's launches at every tile give the reference MLP (what it times is right)."""
    shape = dict(bench.FORMATS["fp8 qwen3"], experts=4, hidden=256, inter=64, top_k=2)
    tensors = bench.experts_of(shape, torch.device(device))
    ids = torch.tensor([[0, 3], [2, 1]], device=device, dtype=torch.int32)
    x, router = torch.randn(2, 256, device=device), torch.rand(2, 2, device=device)
    ops = bench.quant_operands(x, tensors, router, ids, shape["scheme"])
    reference = moe_apply_quant_torch(x, tensors, router, ids, scheme=shape["scheme"])
    for tile in bench.tiles(True, pieces=True):
        act, part = torch.empty(4, 64, device=device), torch.empty(4, 256, device=device)
        bench.launch_gate_up(x, ops, ids, act, tile)
        bench.launch_down(act, ops, ids, router, part, True, tile)
        torch.testing.assert_close(part.view(2, 2, 256).sum(1), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--formats", "fp9"]])
def test_bad_flags_exit_2(bench, monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "argv", ["bench_quant_gemv.py", *argv])
    try:
        code = bench.main()
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert "bench_quant_gemv.py" in capsys.readouterr().err
