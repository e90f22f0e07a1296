"""benchmarks/bench_batch.py, bench_copy_service.py, bench_routing_launches.py: flags, plans, the floor variant.

``device copies only`` (the floor of any apply) must run the same admissions and copies as
the cached step it is the floor of; the dry run (tiny shapes, CPU, interpreted, the real
Qwen3 trace or, where it is absent, a synthetic one in its format) checks that on its CSV
rows, not on timings.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BENCHMARKS, bench_module, traces_env


@pytest.mark.parametrize(
    "module, flags, message",
    [
        ("bench_batch", ["--floor", "0.3"], "--floor 0.3 is not among --fractions"),  # floor at a fraction not run
        ("bench_batch", ["--serial", "0.3"], "--serial 0.3 is not among --fractions"),
        ("bench_batch", ["--unlanded", "0.3"], "--unlanded 0.3 is not among --fractions"),
        ("bench_batch", ["--landed-whole", "0.3"], "--landed-whole 0.3 is not among --fractions"),
        ("bench_batch", ["--overlap", "maybe"], "--overlap: invalid choice"),
        ("bench_batch", ["--chain", "yes"], "--chain: invalid choice"),
        ("bench_batch", ["--copy-priority", "low"], "--copy-priority: invalid choice"),
        ("bench_batch", ["--replot", "abc", "--ste", "3"], "--replot draws the CSV's rows"),  # abbreviated too
        ("bench_batch", ["--lookahead", "1", "0"], "--lookahead takes layers ahead of at least 1, got 0"),
        ("bench_batch", ["--lookahead", "3", "--prefetch"], "--lookahead sets how far the oracle prefetches go"),
        ("bench_batch", ["--lookahead", "1", "--prefill", "16"], "--lookahead sets how far the oracle prefetches"),
        ("bench_batch", ["--across", "2", "--prefetch"], "--across adds oracle prefetches across steps: it needs"),
        ("bench_batch", ["--across", "2", "--prefill", "16"], "--across adds oracle prefetches across steps"),
        ("bench_batch", ["--prefetch", "0.25", "--across", "0"], "--across takes layers ahead in 1..11"),
        ("bench_batch", ["--prefetch", "0.25", "--across", "2", "12"], "--across takes layers ahead in 1..11"),
        ("bench_batch", ["--prefetch", "0.25", "--across", "3", "--layers", "3"], "in 1..2 (fewer than the 3"),
        ("bench_copy_service", ["--misses", "0"], "--misses must lie in 1..64"),
        ("bench_copy_service", ["--misses", "65"], "--misses must lie in 1..64"),  # more than the slots
        ("bench_copy_service", ["--layers", "0"], "--layers and --repeats >= 1"),
        ("bench_copy_service", ["--switch", "--misses", "32"], "--switch takes --misses up to 16"),  # handles by value
        ("bench_routing_launches", ["--tokens", "1024", "8"], "--tokens must exceed 8"),  # the register kernel's
        ("bench_routing_launches", ["--batch-sizes", "0"], "--batch-sizes must be >= 1"),
        ("bench_routing_launches", ["--kernels", "gemm"], "--kernels: invalid choice"),
    ],
)
def test_bad_flags_exit_2_with_one_line(module, flags, message, monkeypatch, capsys):
    """Parsed before any GPU work (in this process: a subprocess each would pay torch's start-up)."""
    bench = bench_module(module)
    monkeypatch.setattr(sys, "argv", [f"{module}.py", *flags])
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args() if module != "bench_copy_service" else bench.main()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert message in lines[-1] and not any("Traceback" in line for line in lines)


def test_replot_draws_the_newest_default_rows_of_the_given_commits(tmp_path, monkeypatch, capsys):
    """Ablation rows (here --copy-priority default) and other commits stay out; a later row of
    the same variant, cache and batch wins; no such rows or no CSV: one line, exit status 2."""
    bench = bench_module("bench_batch")
    monkeypatch.setattr(bench._common, "RESULTS", tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        bench.replot_rows(["aaa"])
    assert exit_info.value.code == 2 and "no " in capsys.readouterr().err
    fields = ["commit", "variant", "cache", "batch", "tok_per_s", "copy_priority", "error", "landing"]
    rows = [
        ["aaa", "device", "25%", "8", "100", "", "", ""],  # older rows carry no ablation columns
        ["aaa", "device", "25%", "8", "120", "high", "", ""],  # newer: wins
        ["aaa", "device", "25%", "16", "999", "default", "", ""],  # an ablation
        ["aaa", "device unlanded", "25%", "16", "998", "high", "", "off"],  # the --unlanded ablation
        ["bbb", "device", "25%", "16", "150", "high", "", ""],  # another commit
        ["aaa", "host", "25%", "16", "", "high", "CacheCapacityError", ""],  # a failed row
        ["aaa", "resident", "all", "16", "300", "high", "", ""],
    ]
    with (tmp_path / "bench_batch.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([fields, *rows])
    got = sorted((row["variant"], row["batch"], row["tok_per_s"]) for row in bench.replot_rows(["aaa"]))
    assert got == [("device", 8, 120.0), ("resident", 16, 300.0)]
    assert sorted(row["batch"] for row in bench.replot_rows(["aaa", "bbb"])) == [8, 16, 16]
    with pytest.raises(SystemExit) as exit_info:
        bench.replot_rows(["ccc"])
    assert exit_info.value.code == 2 and "no decode rows of commit ccc" in capsys.readouterr().err


def test_plot_gives_a_variant_one_color_in_every_panel(tmp_path, monkeypatch):
    """The one legend names each variant once, so its line must look the same in every panel,
    whichever variants a panel lacks (here host at 100%: the device line comes second there);
    the floor and the oracle prefetches are not drawn (no user can serve so)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    bench = bench_module("bench_batch")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    rows = [{"variant": variant, "cache": cache, "batch": batch, "tok_per_s": 10.0 + batch}
            for variant, caches in (("resident", ["all"]), ("host", ["25%"]), ("device", ["25%", "100%"]),
                                    ("device copies only", ["25%"]), ("device prefetch 8/8", ["25%"]))
            for cache in caches for batch in (1, 2)]  # fmt: skip
    assert bench.plot(rows, [0.25, 1.0], tmp_path / "plot.png", "title") == tmp_path / "plot.png"
    (figure,) = figures
    colors = {}
    for axis in figure.axes:
        for line in axis.get_lines():
            colors.setdefault(line.get_label(), set()).add(line.get_color())
    assert set(colors) == {"resident", "host", "device"}
    assert all(len(seen) == 1 for seen in colors.values())
    assert len({next(iter(seen)) for seen in colors.values()}) == 3
    (legend,) = figure.legends  # one, beside the panels
    assert [text.get_text() for text in legend.get_texts()] == ["resident", "host", "device"]
    plt.close(figure)


def test_copy_service_plans_name_distinct_experts_and_slots():
    bench = bench_module("bench_copy_service")
    plans = bench.random_plans(3, 4, 5, torch.Generator().manual_seed(0))
    assert plans.shape == (3, 4, 1 + 2 * bench.MAX_COPIES) and plans.dtype == torch.int32
    assert (plans[..., 0] == 5).all()
    experts, slots = plans[..., 1:11:2], plans[..., 2:12:2]
    assert (plans[..., 11:] == -1).all()  # past the count: never read, marked
    for layer_experts, layer_slots in zip(experts.reshape(-1, 5), slots.reshape(-1, 5), strict=True):
        assert len(set(layer_experts.tolist())) == 5 and 0 <= layer_experts.min() <= layer_experts.max() < bench.EXPERTS
        assert len(set(layer_slots.tolist())) == 5 and 0 <= layer_slots.min() <= layer_slots.max() < bench.SLOTS


#: Every variant the floor test compares, and the rows they write.
_FLOOR_ONLY = ["device 25%", "global 25%", "copies only", "serial", "unlanded", "landed whole"]
_FLOOR_VARIANTS = {"resident", "dense only", "device", "device copies only", "device global",
                   "device global copies only", "device serial", "device unlanded", "device landed whole"}  # fmt: skip
#: At batch 8 (calls in passes) the per-layer rows only: each variant costs ~20 s interpreted
#: there, and the others' wiring does not change with the batch size.
_FLOOR_ONLY_8 = ["device 25%", "device copies only", "serial"]


@pytest.mark.parametrize("batch", ["1", "8"])  # one run each: together they took 300 s on a loaded machine
def test_the_floor_runs_the_same_copies_as_the_cached_step(tmp_path, batch):
    """Also the ``--serial`` rows: the same function, passes one after the other (full
    groups where the overlapped rows take half ones); and (batch 1) the ``--unlanded`` rows:
    the same copies and output, the apply waiting for whole copies; the ``--landed-whole``
    rows: the same, gate_up waiting for whole experts, not their w1; the shared pool's floor
    (``device global copies only``) against ``device global``. The ``dense only`` row (the
    resident step without expert compute) copies nothing and sets every cached row's causal
    bound."""
    every = batch == "1"
    flags = ["--dry-run", "--only", *(_FLOOR_ONLY if every else _FLOOR_ONLY_8), "--batch-sizes", batch,
             "--fractions", "0.25", "--serial", "0.25", "--unlanded", "0.25", "--landed-whole", "0.25", "--coded",
             "--prefetch", "--layers", "2"]  # fmt: skip
    command = [sys.executable, str(BENCHMARKS / "bench_batch.py"), *flags]
    # interpreted kernels: ~280 s on the GPU machine's CPUs beside 13 other test workers (runs 109-110)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, cwd=BENCHMARKS, env=traces_env(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    path = Path(re.search(r"^CSV: (.+)$", done.stdout, re.MULTILINE).group(1))
    with path.open(newline="") as handle:
        rows = {(row["variant"], row["batch"]): row for row in csv.DictReader(handle)}
    expected = _FLOOR_VARIANTS if every else {"resident", "dense only", "device", "device copies only", "device serial"}
    assert {variant for variant, _ in rows} == expected
    cached, floor, one_by_one = (
        rows[("device", batch)],
        rows[("device copies only", batch)],
        rows[("device serial", batch)],
    )
    assert float(cached["mb_copied_per_step"]) > 0
    for column in ("mb_copied_per_step", "hit_rate", "max_passes"):
        assert cached[column] == floor[column], column
    assert float(cached["rel_err"]) == 0.0 == float(one_by_one["rel_err"])  # the resident step's output
    assert floor["rel_err"] == ""  # the floor computes no experts: no output to compare
    assert (cached["overlap"], one_by_one["overlap"]) == ("on", "off")
    compared = [cached, floor, one_by_one]
    if every:
        shared, shared_floor = rows[("device global", batch)], rows[("device global copies only", batch)]
        for column in ("mb_copied_per_step", "hit_rate", "max_passes"):
            assert shared[column] == shared_floor[column], column
        assert float(shared["rel_err"]) == 0.0 and shared_floor["rel_err"] == ""
        whole = rows[("device unlanded", batch)]
        for column in ("mb_copied_per_step", "hit_rate", "max_passes"):
            assert cached[column] == whole[column], column
        assert float(whole["rel_err"]) == 0.0 and (cached["landing"], whole["landing"]) == ("", "off")
        alike = rows[("device landed whole", batch)]
        for column in ("mb_copied_per_step", "hit_rate", "max_passes"):
            assert cached[column] == alike[column], column
        assert float(alike["rel_err"]) == 0.0 and alike["landing"] == "whole"
        compared.append(whole)
    resident, dense = rows[("resident", batch)], rows[("dense only", batch)]
    assert float(dense["mb_copied_per_step"]) == 0 and dense["rel_err"] == ""
    for row in compared:
        causal = max(float(resident["ms_per_step"]), float(dense["ms_per_step"]) + float(row["copy_ms"]))
        assert float(row["causal_bound_ms"]) == pytest.approx(causal, rel=1e-12)
        assert float(row["ratio_to_causal"]) == pytest.approx(float(row["ms_per_step"]) / causal, rel=1e-12)
    if not every:  # 8 tokens may need more experts than a quarter of them: overlapped passes take half groups
        assert int(rows[("device", "8")]["max_passes"]) > int(rows[("device serial", "8")]["max_passes"]) > 1


def dry_run_rows(tmp_path: Path, flags: list[str]) -> dict[str, dict[str, str]]:
    """Run ``bench_batch.py`` with ``flags`` (a dry run) in a subprocess; its CSV rows by variant."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_batch.py"), *flags],
        capture_output=True, text=True, timeout=300, cwd=BENCHMARKS, env=traces_env(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    path = Path(re.search(r"^CSV: (.+)$", done.stdout, re.MULTILINE).group(1))
    with path.open(newline="") as handle:
        return {row["variant"]: row for row in csv.DictReader(handle)}


def test_oracle_prefetches_two_layers_ahead_copy_alike_and_serve_the_model(tmp_path):
    """``--lookahead 1 2``: one row per depth; an oracle that guesses every id leaves each
    layer after the first all hits at either depth, so the calls' hit rates and the bytes
    copied (calls and prefetches) agree, and both outputs are the resident step's."""
    flags = ["--dry-run", "--only", "prefetch 8/8", "--batch-sizes", "1", "--fractions", "0.25", "--prefetch",
             "0.25", "--lookahead", "1", "2", "--coded", "--floor", "--layers", "3"]  # fmt: skip
    rows = dry_run_rows(tmp_path, flags)
    one, two = rows["device prefetch 8/8"], rows["device prefetch 8/8 ahead 2"]
    for column in ("hit_rate", "mb_copied_per_step", "mb_prefetched_per_step"):
        assert one[column] == two[column], column
    assert float(one["mb_prefetched_per_step"]) > 0
    assert float(one["rel_err"]) == 0.0 == float(two["rel_err"])


def test_oracle_prefetches_across_steps_leave_every_call_all_hits(tmp_path):
    """``--across 1 2``: the last routers prefetch the next step's first layers, so with every
    guess right each timed step's calls hit every expert (layer 0's too, unlike the rows that
    stay within a step), and the outputs are the resident step's."""
    flags = ["--dry-run", "--only", "prefetch 8/8", "--batch-sizes", "1", "--fractions", "0.25", "--prefetch",
             "0.25", "--lookahead", "2", "--across", "1", "2", "--coded", "--floor", "--layers", "3"]  # fmt: skip
    rows = dry_run_rows(tmp_path, flags)
    within = rows["device prefetch 8/8 ahead 2"]
    for name in ("device prefetch 8/8 ahead 1 across", "device prefetch 8/8 ahead 2 across"):
        assert float(rows[name]["hit_rate"]) == 1.0, name
        assert float(rows[name]["rel_err"]) == 0.0
        assert float(rows[name]["mb_copied_per_step"]) == float(rows[name]["mb_prefetched_per_step"]) > 0
    assert float(within["hit_rate"]) < 1.0  # layer 0 misses: nothing within a step comes before its router


def test_switch_copies_refuse_what_they_cannot_serve():
    """The SWITCH-node copies (`_switch_copies.py`) take 1-16 misses a layer, refused before any
    CUDA call; without a GPU, the reason is named."""
    switch = bench_module("_switch_copies")
    for misses in (0, switch.MAX_SWITCHES + 1):
        with pytest.raises(ValueError, match="misses must lie in 1..16"):
            switch.SwitchCopies(None, (0,), (8,), [], 4, misses, chained=True)
    if not torch.cuda.is_available():
        assert switch.unavailable() == "no GPU"


def test_landed_whole_rows_count_every_name_alike_and_only_they_do():
    """``--landed-whole``: inside its rows a layer's landing counts keep no name apart (gate_up
    waits for whole experts); outside, w1 counts apart again, also after an error."""
    from helpers import random_weights

    from expertcache.layout import layout_from_weights
    from expertcache.mover import copy_groups, landing_counting
    from expertcache.store import CPUBackingStore

    bench = bench_module("bench_batch")
    weights = random_weights(4, 32, 16)
    groups = copy_groups(CPUBackingStore(layout_from_weights(weights)[1], weights, pin=False))
    split = landing_counting(groups)
    assert split is not None and split.gate_up_mask != -1
    with bench.counting_names_alike():
        alike = landing_counting(groups)
        assert alike is not None and alike.gate_up_mask == -1 and alike.gate_up_target == alike.target
    with pytest.raises(RuntimeError, match="inside"), bench.counting_names_alike():
        raise RuntimeError("inside")
    assert landing_counting(groups) == split
