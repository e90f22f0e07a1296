"""Per-layer vs global slot budget, replayed on the real multi-layer traces in ``shared/traces``.

The same GPU memory two ways: ``N`` slots in a private pool per MoE layer, or one pool of
``N * L`` slots shared by all ``L`` layers (keys ``(layer, expert)``, LRU over all of them).
Every fused-MoE call is admitted through `expertcache.slot_table.SlotTable` exactly as the
runtime cache admits it (calls whose distinct experts exceed the slots run in expert-group
passes, `expertcache.passes`, as every runtime path does), forward by forward and layer by
layer. Prints hit rates and misses (each miss is one expert copied).

Only the traces that cover every layer of a model can tell the two budgets apart:
Mixtral-8x7B (``routing_raw.jsonl``: prefill + decode, aligned across layers; the two
decode-only files, aligned only approximately, see the traces' README) and Qwen3-30B-A3B
(four 48-layer windows). The single-layer Qwen1.5-MoE and OLMoE traces are identical under
both budgets and are skipped.

This reads the trace files with a few lines of its own, for this measurement only; the
project's loaders into `RoutingTrace` are issue 5's (``expertcache.trace.loaders``).

Run from the repository root (CPU only, a few seconds)::

    python benchmarks/budget_replay.py [--traces DIR]   (default: $EXPERTCACHE_TRACES, ../shared/traces)
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np
from _common import traces_dir

from expertcache.slot_table import SlotTable

MIXTRAL = "mixtral-8x7b-instruct-fp8__speculative-moe"
QWEN3 = "qwen3-30b-a3b-instruct-2507__local-moe-inference-stack"

# A forward pass: one (layer, [T, K] expert ids) call per MoE layer, in layer order.
Forward = list[tuple[int, np.ndarray]]


def _records(path: Path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def mixtral_raw(path: Path) -> list[Forward]:
    """Prefill (one call per layer, every prompt token) then one-token decode steps."""
    records = _records(path)
    prefill: dict[int, list] = collections.defaultdict(list)
    index = 0
    while index < len(records) and (index == 0 or records[index]["layer"] >= records[index - 1]["layer"]):
        prefill[records[index]["layer"]].append(records[index]["experts"])
        index += 1
    forwards = [[(layer, np.array(rows)) for layer, rows in sorted(prefill.items())]]
    step: Forward = []
    for record in records[index:]:
        if step and record["layer"] <= step[-1][0]:  # the layer did not increase: a new step
            forwards.append(step)
            step = []
        step.append((record["layer"], np.array([record["experts"]])))
    return forwards + ([step] if step else [])


def mixtral_decode_only(path: Path) -> list[Forward]:
    """Decode steps of each problem in turn; layers paired by their own token index."""
    sequences: dict[tuple[int, int], list] = collections.defaultdict(list)
    for record in sorted(_records(path), key=lambda r: (r["problem_id"], r["layer"], r["token_idx"])):
        sequences[(record["problem_id"], record["layer"])].append(record["experts"])
    forwards = []
    for problem in sorted({p for p, _ in sequences}):
        layers = sorted(layer for p, layer in sequences if p == problem)
        steps = max(len(sequences[(problem, layer)]) for layer in layers)
        for t in range(steps):
            forwards.append(
                [
                    (layer, np.array([sequences[(problem, layer)][t]]))
                    for layer in layers
                    if t < len(sequences[(problem, layer)])
                ]
            )
    return forwards


def qwen3_window(path: Path) -> list[Forward]:
    """One forward per token, all 48 layers."""
    tokens: dict[tuple, list] = collections.OrderedDict()
    for record in _records(path):
        tokens.setdefault((record["prompt_id"], record["token_pos"]), []).append(
            (record["layer"], np.array([record["experts"]]))
        )
    return list(tokens.values())


def replay(streams: list[list[Forward]], slots_per_layer: int, budget: str) -> dict[str, int]:
    """Hits and misses of LRU over ``streams`` (each starts with an empty cache).

    Returns:
        ``{"hits", "misses", "prefill_misses", "decode_misses"}``; a forward is a prefill
        when one of its calls holds more than one token.
    """
    counts = dict.fromkeys(("hits", "misses", "prefill_misses", "decode_misses"), 0)
    for forwards in streams:
        layers = sorted({layer for forward in forwards for layer, _ in forward})
        if budget == "global":
            index = {layer: position for position, layer in enumerate(layers)}  # keys are (layer, expert)
            shared = SlotTable(
                slots_per_layer * len(layers), num_layers=len(layers), layer_of=lambda key, index=index: index[key[0]]
            )
            tables = {layer: shared for layer in layers}
        else:
            tables = {layer: SlotTable(slots_per_layer) for layer in layers}
        for forward in forwards:
            phase = "prefill_misses" if any(len(ids) > 1 for _, ids in forward) else "decode_misses"
            for layer, ids in forward:
                table = tables[layer]
                keys = [(layer, int(e)) for e in ids.reshape(-1) if e >= 0]
                for admission in table.admit_passes(keys):
                    counts["hits"] += len(admission.hits)
                    counts["misses"] += len(admission.loads)
                    counts[phase] += len(admission.loads)
    return counts


def workloads(root: Path) -> list[tuple[str, int, list[list[Forward]]]]:
    """(name, experts per layer, streams) of every multi-layer trace present."""
    found = []
    mixtral = root / MIXTRAL
    if (mixtral / "routing_raw.jsonl").exists():
        found.append(("mixtral raw (prefill+decode)", 8, [mixtral_raw(mixtral / "routing_raw.jsonl")]))
    decode = [mixtral / name for name in ("humaneval_2_routing.jsonl", "gsm8k_2_routing.jsonl")]
    if all(path.exists() for path in decode):
        found.append(("mixtral decode-only x2", 8, [mixtral_decode_only(path) for path in decode]))
    windows = sorted((root / QWEN3).glob("window_*.jsonl"))
    if windows:
        found.append((f"qwen3-30b-a3b {len(windows)} windows", 128, [qwen3_window(p) for p in windows]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=None, help="default: benchmarks/_common.traces_dir()")
    args = parser.parse_args()
    args.traces = args.traces or traces_dir()
    print("misses = experts copied host -> GPU (lower is better); hit = hits / lookups")
    header = f"{'trace':<30} {'slots/layer':>11} {'budget':>9} {'hit':>6} {'misses':>7} {'prefill':>8} {'decode':>7}"
    print(header)
    print("-" * len(header))
    for name, num_experts, streams in workloads(args.traces):
        for fraction in (0.25, 0.5, 0.75):
            slots = max(2, round(fraction * num_experts))
            for budget in ("per-layer", "global"):
                c = replay(streams, slots, budget)
                print(
                    f"{name:<30} {slots:>5}/{num_experts:<5} {budget:>9} "
                    f"{c['hits'] / (c['hits'] + c['misses']):>6.1%} {c['misses']:>7} "
                    f"{c['prefill_misses']:>8} {c['decode_misses']:>7}"
                )


if __name__ == "__main__":
    main()
