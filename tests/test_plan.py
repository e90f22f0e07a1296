"""``expertcache plan``: scores, bounds, the recommendation, the manifest path, the plot."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from helpers import random_weights, real_traces

from expertcache import CachedWeightProvider
from expertcache.cli import main
from expertcache.planner import RUNTIME_POLICIES, PlanRow, best_policy, plan
from expertcache.trace import RoutingTrace

TRACES = real_traces()


def _trace(tokens: int = 60, layers: int = 2, experts: int = 8, top_k: int = 2) -> RoutingTrace:
    """Skewed routing with locality: each token mostly repeats the previous token's choice."""
    generator = np.random.default_rng(0)
    ids = np.empty((tokens, layers, top_k), dtype=np.int16)
    popularity = 1 / np.arange(1, experts + 1)
    for token in range(tokens):
        for layer in range(layers):
            if token and generator.random() < 0.5:
                ids[token, layer] = ids[token - 1, layer]
            else:
                p = popularity / popularity.sum()
                ids[token, layer] = generator.choice(experts, top_k, replace=False, p=p)
    # a 10-token prefill, then one token per forward
    starts = np.concatenate([[0], np.arange(10, tokens)])
    return RoutingTrace(ids, starts, num_experts=experts, model="synthetic")


def test_bounds_hold_at_every_size():
    result = plan(_trace(), expert_bytes=1000, gpu_budget_bytes=6 * 1000)
    for row in result.rows:
        belady = result.row(row.scope, row.slots, "belady")
        ceiling = result.row(row.scope, row.slots, "unbounded")
        assert row.hit_rate <= belady.hit_rate <= ceiling.hit_rate or row.policy == "unbounded"
    assert result.budget_slots == 6
    assert result.layer_cache_size == 3  # 6 slots over 2 layers
    assert result.global_slots == 6
    assert result.budget_fraction == 3 / 8


def test_costs_follow_from_misses():
    trace = _trace()
    result = plan(trace, expert_bytes=2_000_000, gpu_budget_bytes=8_000_000, bandwidth_bytes_per_second=4e9)
    row = result.row("layer", 2, "lru")
    assert row.misses_per_token == pytest.approx(row.misses / trace.num_tokens)
    assert row.gb_per_token == pytest.approx(row.misses_per_token * 2e6 / 1e9)
    assert row.tokens_per_second == pytest.approx(4e9 / (row.misses_per_token * 2e6))
    scaled = plan(trace, expert_bytes=2_000_000, gpu_budget_bytes=8_000_000, model_layers=8)
    assert scaled.row("layer", 2, "lru").misses_per_token == pytest.approx(
        row.misses_per_token * 4
    )  # 8 model layers, 2 traced


def test_lru_is_kept_unless_beaten_by_the_margin():
    def row(policy, hit_rate):
        return PlanRow("layer", 4, 0.5, policy, 0, 0, hit_rate, 0.0, 0.0, None, 0)

    assert best_policy([row("lru", 0.700), row("arc", 0.704)]) == "lru"
    assert best_policy([row("lru", 0.700), row("arc", 0.710)]) == "arc"
    assert best_policy([row("lru", 0.9), row("belady", 0.99)]) == "lru"  # a bound, not a choice


def test_cli_prints_table_recommendation_csv_and_plot(tmp_path, capsys):
    trace = _trace()
    trace.save(tmp_path / "trace.npz")
    args = ["plan", "--trace", str(tmp_path / "trace.npz"), "--expert-bytes", "1000"]
    args += ["--gpu-budget", "6e-6", "--bandwidth", "1", "--no-progress"]
    args += ["--plot", str(tmp_path / "plan.png"), "--csv", str(tmp_path / "plan.csv")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "recommendation: --moe-expert-cache-size 3" in out
    assert "expert-group passes" in out  # the 10-token prefill needs more than 3 distinct experts
    assert "belady" in out and "unbnd" in out
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(tmp_path / "plan.csv")))
    policies = {row["policy"] for row in rows}
    assert policies == {*RUNTIME_POLICIES, "belady", "unbounded"}
    assert {row["scope"] for row in rows} == {"layer", "global"}


def test_table_figures_wider_than_their_columns_stay_apart(tmp_path, capsys):
    """Tiny experts at a high bandwidth: tok/s has more digits than its column, and the
    figures are still separated (they ran together: '0.00015337299.0')."""
    _trace().save(tmp_path / "trace.npz")
    args = ["plan", "--trace", str(tmp_path / "trace.npz"), "--expert-bytes", "1", "--gpu-budget", "6e-9"]
    assert main([*args, "--bandwidth", "1000", "--no-progress", "--policies", "lru"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("pool"))
    rows = [line for line in lines[header + 2 :] if line.startswith(("layer", "global"))]
    assert rows
    for row in rows:  # pool, slots, %exp, lru, belady, unbnd, best, miss/tok, GB/tok, tok/s
        fields = row.replace("*", " ").split()
        assert len(fields) == 10, row
        assert float(fields[-1]) >= 1e7, row  # wider than the column of 8


def test_cli_reads_expert_bytes_from_a_manifest(tmp_path, capsys):
    weights = random_weights(8, 16, 8)
    provider = CachedWeightProvider(weights, cache_size=2, device="cpu")
    provider.manifest().write(tmp_path / "manifest.json")
    _trace().save(tmp_path / "trace.npz")
    record = provider.manifest().expert_bytes
    args = ["plan", "--trace", str(tmp_path / "trace.npz"), "--manifest"]
    args += [str(tmp_path / "manifest.json"), "--no-progress"]
    args += ["--gpu-budget", str(4 * record / 1e9)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"expert bytes {record:,}" in out
    assert "--moe-expert-cache-size 2" in out


@pytest.mark.parametrize("budget", ["1e-6", "3e-6"])  # 0 and 1 slots a layer, of top-2
def test_a_budget_below_top_k_slots_per_layer_says_so(tmp_path, capsys, budget):
    _trace().save(tmp_path / "trace.npz")
    args = ["plan", "--trace", str(tmp_path / "trace.npz"), "--expert-bytes", "1000"]
    assert main([*args, "--gpu-budget", budget, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "fewer than the 2 a cache needs (the router's top-k" in out and "raise --gpu-budget" in out
    assert "recommendation:" not in out
    assert "\nlayer       1 " not in out  # a size the runtime refuses is not scored


@pytest.mark.skipif(not TRACES.is_dir(), reason="no real routing traces (../shared/traces)")
def test_cli_accepts_a_shared_trace_file_directly(capsys):
    path = TRACES / "olmoe-1b-7b-0924__cerebras-assesment2" / "moe_routes.jsonl"
    args = ["plan", "--trace", str(path), "--expert-bytes", "12600000", "--gpu-budget", "1.7"]
    assert main([*args, "--layers", "16", "--policies", "lru,arc", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "allenai/OLMoE-1B-7B-0924" in out
    assert "--moe-expert-cache-size 8" in out  # 1.7 GB = 134 slots over 16 layers


def test_overlapped_passes_replay_as_a_decode_stack_serves_them(tmp_path, capsys):
    """The 10-token prefill does not fit a pool of 2-3 slots: ``oversize="overlapped"``
    replays it in groups of half the share, as ``passes(ids, overlap=True)`` does, and the
    counts are that replay's; the CLI flag says which one it ran."""
    from expertcache.sim import replay_streams, trace_calls

    trace = _trace()
    plain, overlapped = (
        plan(trace, expert_bytes=1000, gpu_budget_bytes=6000, policies=["lru"], oversize=oversize)
        for oversize in ("passes", "overlapped")
    )
    for result, oversize in ((plain, "passes"), (overlapped, "overlapped")):
        for policy in ("lru", "belady"):
            row = result.row("layer", 2, policy)
            replayed = replay_streams(trace_calls(trace, scope="layer"), policy=policy, capacity=2, oversize=oversize)
            assert (row.hits, row.misses, row.split_calls) == (replayed.hits, replayed.misses, replayed.split_calls)
    assert plain.rows != overlapped.rows  # other groups, other decisions (here Belady's)
    with pytest.raises(ValueError, match="oversize"):
        plan(trace, expert_bytes=1000, gpu_budget_bytes=6000, oversize="raise")
    with pytest.raises(ValueError, match="overlap_max_ids"):
        plan(trace, expert_bytes=1000, gpu_budget_bytes=6000, overlap_max_ids=8)  # oversize="passes" ignores it
    with pytest.raises(ValueError, match="overlap_max_ids"):
        plan(trace, expert_bytes=1000, gpu_budget_bytes=6000, oversize="overlapped", overlap_max_ids=0)
    limited = plan(trace, expert_bytes=1000, gpu_budget_bytes=6000, policies=["lru"], oversize="overlapped",
                   overlap_max_ids=1)  # fmt: skip
    assert limited.rows == plain.rows  # no call has at most one id: every one replayed one pass after the other
    path = tmp_path / "trace.npz"
    trace.save(path)
    common = ["plan", "--trace", str(path), "--expert-bytes", "1000", "--gpu-budget", "0.000006", "--no-progress"]
    assert main([*common, "--overlapped-passes"]) == 0
    assert "calls that do not fit: overlapped passes" in capsys.readouterr().out
    assert main(common) == 0
    assert "calls that do not fit: passes one after the other" in capsys.readouterr().out


def test_the_readme_synopsis_lists_every_plan_flag():
    import re
    from pathlib import Path

    from expertcache.cli import build_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Command line", 1)[1].split("```", 2)[1]
    synopsis = block[block.index("expertcache plan") :]
    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    flags = {name for action in subparsers.choices["plan"]._actions for name in action.option_strings}
    missing = [
        flag for flag in sorted(flags - {"-h", "--help"}) if not re.search(re.escape(flag) + r"(?![\w-])", synopsis)
    ]
    assert not missing, f"README's synopsis of plan lacks {missing}"


@pytest.mark.skipif(not TRACES.is_dir(), reason="no real routing traces (../shared/traces)")
def test_every_shared_trace_folder_loads_but_the_one_mixing_formats():
    """What the README says --trace takes: a folder whose routing files share one format."""
    from expertcache.trace import load_trace

    for folder in sorted(path for path in TRACES.iterdir() if path.is_dir()):
        if folder.name.startswith("mixtral"):  # decode_routing and raw_routing_log files
            with pytest.raises(ValueError, match="mixes trace formats; load one file"):
                load_trace(folder)
        else:
            assert load_trace(folder).num_records > 0, folder
