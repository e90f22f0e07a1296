"""Loaders for the two per-token routing logs of the speculative-moe project (Mixtral-8x7B).

``raw`` log (one prompt, execution order)::

    {"dataset", "problem_id", "layer", "token_pos", "experts": [K], "gating_probs": [K]}

prefill first, layer by layer (a run of ``token_pos`` 0..P-1 per layer), then one record
per layer per decode step with ``token_pos`` 0: a step starts whenever ``layer`` does not
increase. ``decode``-only files::

    {"dataset", "problem_id", "layer", "experts": [K], "gating_probs": [K], "token_idx"}

grouped by (problem, layer), ``token_idx`` numbered per layer *after* records were lost.

Known defect of both: the logger skipped every token whose gate weights were exactly
[0.5, 0.5] (meant for padding, it also hit real bf16 ties): about 2.8% of the (token, layer)
records are missing. In the raw log a missing record is a -1 row at its exact place. In the
decode files the per-layer order is exact but the rows are *not aligned across layers*
after a loss, so only per-layer replay is faithful; each layer's rows are laid down in
order and padded with -1 at the end.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from expertcache.trace.format import RoutingTrace
from expertcache.trace.jsonl import empty_ids, infer_num_experts, missing_note, read_jsonl

DROPPED_TIES = (
    "Records of tokens whose two gate weights tied at exactly [0.5, 0.5] were dropped by "
    "the recorder (about 2.8% of records)."
)


def load_raw_routing_log(path: str | Path, *, num_experts: int | None = None, model: str = "") -> RoutingTrace:
    """Load a raw prefill-then-decode log: forward 0 is the prefill, then one per step.

    Returns:
        `RoutingTrace` with ``expert_ids`` ``[P + steps, L, K]``, -1 where a record was lost.
    """
    records = list(read_jsonl(path))
    if not records:
        raise ValueError(f"{path}: empty")
    layers = [int(record["layer"]) for record in records]
    prefill_end = next((i for i in range(1, len(layers)) if layers[i] < layers[i - 1]), len(records))
    prefill = records[:prefill_end]
    prompt_tokens = max(int(record["token_pos"]) for record in prefill) + 1
    steps: list[list[dict]] = []
    for index in range(prefill_end, len(records)):
        if index == prefill_end or layers[index] <= layers[index - 1]:
            steps.append([])
        steps[-1].append(records[index])
    ids = empty_ids(prompt_tokens + len(steps), max(layers) + 1, len(records[0]["experts"]))
    for record in prefill:
        ids[int(record["token_pos"]), int(record["layer"])] = record["experts"]
    for step, step_records in enumerate(steps):
        for record in step_records:
            ids[prompt_tokens + step, int(record["layer"])] = record["experts"]
    return RoutingTrace(
        expert_ids=ids,
        forward_starts=np.concatenate([[0], prompt_tokens + np.arange(len(steps))]),
        request_starts=np.zeros(1, np.int64),
        num_experts=infer_num_experts(ids, num_experts),
        model=model,
        source=str(path),
        notes=(
            f"Prefill of {prompt_tokens} tokens (one forward), then {len(steps)} decode steps. "
            f"{DROPPED_TIES} {missing_note(ids)}"
        ),
    )


def load_decode_routing(path: str | Path, *, num_experts: int | None = None, model: str = "") -> RoutingTrace:
    """Load a decode-only file: one token per forward, problems one after another.

    Returns:
        `RoutingTrace`; rows are exact per layer but not aligned across layers (see notes).
    """
    per_layer: dict[tuple[int, int], list[tuple[int, list[int]]]] = defaultdict(list)
    problems: dict[int, None] = {}
    for record in read_jsonl(path):
        problem = int(record["problem_id"])
        problems.setdefault(problem)
        per_layer[(problem, int(record["layer"]))].append((int(record["token_idx"]), record["experts"]))
    if not per_layer:
        raise ValueError(f"{path}: empty")
    num_layers = max(layer for _, layer in per_layer) + 1
    top_k = len(next(iter(per_layer.values()))[0][1])
    lengths = {p: max(len(v) for (q, _), v in per_layer.items() if q == p) for p in problems}
    offsets = dict(zip(problems, np.cumsum([0, *lengths.values()])[:-1].tolist(), strict=True))
    ids = empty_ids(sum(lengths.values()), num_layers, top_k)
    for (problem, layer), rows in per_layer.items():
        rows.sort(key=lambda row: row[0])
        start = offsets[problem]
        ids[start : start + len(rows), layer] = [experts for _, experts in rows]
    return RoutingTrace(
        expert_ids=ids,
        forward_starts=np.arange(ids.shape[0]),
        request_starts=np.array(list(offsets.values()), dtype=np.int64),
        num_experts=infer_num_experts(ids, num_experts),
        model=model,
        source=str(path),
        notes=(
            f"Decode only, one token per forward, {len(problems)} problems. {DROPPED_TIES} "
            "Rows are exact per layer but NOT aligned across layers after a lost record "
            "(token_idx was renumbered per layer); per-layer replay is faithful, a global "
            f"pool is approximate. Shorter layers are padded with -1. {missing_note(ids)}"
        ),
    )
