"""What ``expertcache plan`` prints and writes: the trace's summary, the table of hit rates,
the recommendation, and the ``--csv`` / ``--plot`` files' bytes (rendered in memory, so
nothing is written until all of them are made)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io

from expertcache.passes import OVERLAP_MAX_IDS
from expertcache.planner import Plan, PlanRow


def describe(trace, expert_bytes: int, layers: int, args: argparse.Namespace) -> str:
    lines = [
        f"trace: {args.trace}",
        f"  {trace.model or 'model not recorded'}: {trace.num_tokens} tokens, "
        f"{trace.num_forwards} forward passes, {trace.num_layers} layer(s) traced of {layers}, "
        f"{trace.num_experts} experts, top-{trace.top_k}",
        f"  notes: {trace.notes}" if trace.notes else "",
        f"expert bytes {expert_bytes:,}; GPU budget {args.gpu_budget:g} GB"
        + (f"; copy bandwidth {args.bandwidth:g} GB/s" if args.bandwidth else ""),
        "calls that do not fit: "
        + (
            f"overlapped passes up to {OVERLAP_MAX_IDS:,} ids a call, one after the other above (as DecodeStack)"
            if args.overlapped_passes
            else "passes one after the other"
        ),
    ]
    return "\n".join(line for line in lines if line)


def format_table(result: Plan, policies: list[str]) -> str:
    """Hit rates per policy by pool and size, then Belady, unbounded, and the best's costs."""
    header = (
        f"{'pool':<7}{'slots':>6}{'%exp':>6} "
        + "".join(f"{name:>12}" for name in policies)
        + f"{'belady':>9}{'unbnd':>7}  {'best':<11}{'miss/tok':>9} {'GB/tok':>8} {'tok/s':>8}"
    )
    lines = ["hit rate (%) by policy; costs of the best runtime policy", header, "-" * len(header)]
    keys = dict.fromkeys((row.scope, row.slots) for row in result.rows)
    for scope, slots in keys:
        cells = {name: result.row(scope, slots, name) for name in (*policies, "belady", "unbounded")}
        best = max((cells[name] for name in policies), key=lambda row: row.hit_rate)
        budget = result.layer_cache_size if scope == "layer" else result.global_slots
        marker = "*" if slots == budget else " "
        lines.append(
            f"{scope:<7}{slots:>6}{best.fraction * 100:>5.0f}{marker}"
            + "".join(f"{cells[name].hit_rate * 100:>12.1f}" for name in policies)
            + f"{cells['belady'].hit_rate * 100:>9.1f}{cells['unbounded'].hit_rate * 100:>7.1f}  "
            f"{best.policy:<11}{best.misses_per_token:>9.2f} {best.gb_per_token:>8.3f} "
            # a space before each figure: one wider than its column (tiny experts) never runs into the next
             + (f"{best.tokens_per_second:>8.1f}" if best.tokens_per_second is not None else f"{'-':>8}")
        )
    lines.append("* = the GPU budget's size")
    return "\n".join(lines)


def recommendation(result: Plan, num_experts: int, layers: int) -> str:
    """What to run with, in one paragraph."""
    if result.layer_cache_size < result.min_cache_size:
        return (
            f"The budget buys {result.budget_slots} expert slots, {result.layer_cache_size} per layer "
            f"({layers} layers): fewer than the {result.min_cache_size} a cache needs (the router's top-k, "
            "the smallest --moe-expert-cache-size): raise --gpu-budget."
        )
    layer = result.row("layer", result.layer_cache_size, result.layer_policy)
    pool = result.row("global", result.global_slots, result.global_policy)
    bound = result.row("layer", result.layer_cache_size, "belady")
    warning = ""
    if layer.split_calls:
        warning = (
            f"\n  note: {layer.split_calls} calls of the trace need more distinct experts than "
            f"{result.layer_cache_size} slots; they run in expert-group passes (counted as the "
            "runtime copies them), each pass reloading what the last one evicted."
        )
    return (
        f"recommendation: --moe-expert-cache-size {result.layer_cache_size} "
        f"(of {num_experts} experts per layer, {result.budget_fraction:.0%}) with policy "
        f"'{result.layer_policy}': hit rate {layer.hit_rate:.1%} (Belady {bound.hit_rate:.1%}), "
        f"{layer.misses_per_token:.2f} misses and {layer.gb_per_token:.3f} GB per token.\n"
        f"  one global pool of the same bytes ({result.global_slots} slots over the traced "
        f"layers) with '{result.global_policy}': hit rate {pool.hit_rate:.1%}." + warning
    )


def render(flag: str, result: Plan, name: str, columns: dict[str, int]) -> bytes:
    """The bytes of the ``--csv`` (each row with ``columns`` after its fields) or ``--plot`` file."""
    if flag == "--plot":
        from expertcache.plan_plot import render_plan

        return render_plan(result, title=f"{name}: hit rate vs cache size")
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=[field.name for field in dataclasses.fields(PlanRow)] + list(columns))
    writer.writeheader()
    writer.writerows({**dataclasses.asdict(row), **columns} for row in result.rows)
    return text.getvalue().encode("utf-8")
