"""Compressed bytes in capacity planning and in the metrics: ``expertcache plan --compression
exponent`` costs each miss at the coded bytes (given ratio, measured manifest, stated default)
while the slots stay raw; ``expertcache_compressed_bytes_copied_total`` equals the stats."""

from __future__ import annotations

import csv

import pytest
import torch
from test_compression import coded_weights
from test_metrics import _scrape, _value
from test_plan import _trace

from expertcache import CachedWeightProvider
from expertcache.cli import main
from expertcache.commands.plan_costs import DEFAULT_EXPONENT_RATIO
from expertcache.metrics import start_metrics_server
from expertcache.planner import plan


def test_copy_bytes_change_the_costs_not_the_hits():
    trace = _trace()
    raw = plan(trace, expert_bytes=1000, gpu_budget_bytes=6000, bandwidth_bytes_per_second=1e6)
    coded = plan(trace, expert_bytes=1000, gpu_budget_bytes=6000, bandwidth_bytes_per_second=1e6, copy_bytes=250)
    assert coded.layer_cache_size == raw.layer_cache_size == 3  # slots hold raw bytes: same size bought
    for a, b in zip(raw.rows, coded.rows, strict=True):
        assert (a.scope, a.slots, a.policy, a.hits, a.misses) == (b.scope, b.slots, b.policy, b.hits, b.misses)
        assert b.gb_per_token == pytest.approx(a.gb_per_token / 4)
        if a.misses:
            assert b.tokens_per_second == pytest.approx(4 * a.tokens_per_second)
    with pytest.raises(ValueError, match="copy_bytes must be at least 1"):
        plan(trace, expert_bytes=1000, gpu_budget_bytes=6000, copy_bytes=0)


def _plan_csv(tmp_path, capsys, *extra: str) -> tuple[str, list[dict]]:
    _trace().save(tmp_path / "trace.npz")
    args = ["plan", "--trace", str(tmp_path / "trace.npz"), "--gpu-budget", "6e-6", "--no-progress"]
    assert main([*args, "--csv", str(tmp_path / "plan.csv"), *extra]) == 0
    return capsys.readouterr().out, list(csv.DictReader(open(tmp_path / "plan.csv")))


def _gb(rows: list[dict]) -> dict:
    return {(r["scope"], r["slots"], r["policy"]): float(r["gb_per_token"]) for r in rows}


@pytest.mark.parametrize(
    "flags, per_miss, says",
    [
        ([], 690, f"default ratio {DEFAULT_EXPONENT_RATIO}"),
        (["--compression-ratio", "0.5"], 500, "--compression-ratio 0.5"),
    ],
)
def test_cli_costs_misses_at_the_coded_bytes(tmp_path, capsys, flags, per_miss, says):
    _, raw = _plan_csv(tmp_path, capsys, "--expert-bytes", "1000")
    out, coded = _plan_csv(tmp_path, capsys, "--expert-bytes", "1000", "--compression", "exponent", *flags)
    assert f"bytes per miss {per_miss:,}" in out and says in out
    assert "--moe-expert-cache-size 3" in out  # the budget buys raw slots
    raw_gb, coded_gb = _gb(raw), _gb(coded)
    assert raw_gb.keys() == coded_gb.keys()
    assert all(coded_gb[key] == pytest.approx(raw_gb[key] * per_miss / 1000) for key in raw_gb)


def test_cli_takes_the_bytes_measured_on_the_models_experts(tmp_path, capsys):
    coded = CachedWeightProvider(coded_weights(), cache_size=4, device="cpu", compression="exponent")
    manifest = coded.manifest()
    manifest.write(tmp_path / "manifest.json")
    flags = ["--manifest", str(tmp_path / "manifest.json"), "--num-experts", "9"]  # the manifest's model: 9 experts
    out, _ = _plan_csv(tmp_path, capsys, *flags)
    assert "add --compression exponent" in out and "bytes per miss" not in out  # raw unless asked
    out, _ = _plan_csv(tmp_path, capsys, *flags, "--compression", "exponent")
    assert f"bytes per miss {manifest.compressed_expert_bytes:,}" in out and "measured on the model's experts" in out
    assert manifest.compressed_expert_bytes < manifest.expert_bytes


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--compression-ratio", "0.5"], "--compression-ratio applies with --compression exponent"),
        (["--compression", "exponent", "--compression-ratio", "1.5"], "--compression-ratio: must be at most 1"),
        (["--compression", "exponent", "--compression-ratio", "0"], "must be a positive finite number"),
        (["--compression", "zstd"], "argument --compression: invalid choice: 'zstd'"),
    ],
)
def test_cli_refuses_bad_compression_flags_in_one_line(tmp_path, capsys, flags, message):
    _trace().save(tmp_path / "trace.npz")
    args = ["plan", "--trace", str(tmp_path / "trace.npz"), "--expert-bytes", "1000", "--gpu-budget", "1", *flags]
    try:
        status = main(args)
    except SystemExit as exit_info:  # the parser's refusals
        status = exit_info.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and message in lines[0], lines


def test_metrics_expose_the_compressed_bytes_beside_the_raw_ones():
    layers = {
        "raw": CachedWeightProvider(coded_weights(), cache_size=3, device="cpu"),
        "coded": CachedWeightProvider(coded_weights(), cache_size=3, device="cpu", compression="exponent"),
    }
    server = start_metrics_server(0, providers=layers)
    try:
        for ids in ([[0, 1], [2, 1]], [[4, 5], [0, 5]], [[7, 8], [7, 2]]):  # 3 distinct a call
            for provider in layers.values():
                provider.prepare(torch.tensor(ids))
        samples = _scrape(server)
    finally:
        server.close()
    for layer, provider in layers.items():
        stats = provider.stats
        assert _value(samples, "expertcache_bytes_copied_total", layer) == stats.bytes_h2d > 0
        assert _value(samples, "expertcache_compressed_bytes_copied_total", layer) == stats.compressed_bytes_h2d
    coded = layers["coded"].stats
    assert coded.compressed_bytes_h2d == coded.misses * layers["coded"].store.stored_expert_bytes < coded.bytes_h2d
    assert layers["raw"].stats.compressed_bytes_h2d == layers["raw"].stats.bytes_h2d
