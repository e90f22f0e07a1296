"""Loader for vLLM ``FusedMoE`` route logs (the vllm-expert-profiler schema).

Line 1 is metadata, every other line one token at one layer::

    {"type": "meta", "model_id", "layers_logged": [..], "top_k", ["num_experts"], ...}
    {"type": "route", "req_id", "token_idx", "layer", "topk_ids": [K], "topk_weights": [K]}

Two variants exist in ``shared/traces``: ``token_idx`` restarting at 0 at each forward batch
(Qwen1.5-MoE: the batch boundaries are the forward passes), or a global counter (OLMoE:
no batch boundaries, so each token is taken as its own forward pass).

Known defect of both: vLLM's memory-profiling and warm-up forwards are logged too, as a
leading run of one repeated row (Qwen1.5: batches 0-2, 16,640 rows; OLMoE: 2,048 rows with
uniform weights). The loader drops a leading run of identical rows of at least
``min_dummy_rows`` and says so in ``notes``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from expertcache.trace.format import RoutingTrace
from expertcache.trace.jsonl import empty_ids, infer_num_experts, read_jsonl


def load_route_log(path: str | Path, *, num_experts: int | None = None, min_dummy_rows: int = 64) -> RoutingTrace:
    """Load a route log; drop the leading profiling dummies.

    Returns:
        `RoutingTrace` with ``expert_ids`` ``[N, L, K]`` (``L`` = layers logged).
    """
    lines = read_jsonl(path)
    meta = next(lines, None)
    if meta is None or meta.get("type") != "meta":
        raise ValueError(f"{path}: the first line is not a route-log meta record")
    rows = [line for line in lines if line.get("type") == "route"]
    if not rows:
        raise ValueError(f"{path}: no route records")
    positions = np.array([int(row["token_idx"]) for row in rows])
    batched = bool((positions[1:] == 0).any())
    dummies = _leading_dummies(rows, positions, batched, min_dummy_rows)
    rows, positions = rows[dummies:], positions[dummies:]
    layers = sorted({int(row["layer"]) for row in rows})
    column = {layer: index for index, layer in enumerate(layers)}
    row_layers = np.array([column[int(row["layer"])] for row in rows])
    if batched:
        tokens, starts = _batched_tokens(positions, row_layers)
        forward_starts = np.asarray(starts, dtype=np.int64)
        how = (
            f"{len(forward_starts)} forward batches from token_idx restarts; request "
            "boundaries inside a batch are not logged."
        )
    else:
        tokens = positions - positions.min()
        forward_starts = np.arange(int(tokens.max()) + 1)
        how = "No batch or request boundaries: every token is taken as its own forward pass."
    ids = empty_ids(int(tokens.max()) + 1, len(layers), int(meta["top_k"]))
    ids[tokens, row_layers] = [row["topk_ids"] for row in rows]
    return RoutingTrace(
        expert_ids=ids,
        forward_starts=forward_starts,
        num_experts=infer_num_experts(ids, num_experts or meta.get("num_experts")),
        model=str(meta.get("model_id", "")),
        layers=np.asarray(layers),
        source=str(path),
        notes=f"Dropped {dummies} leading identical rows (vLLM profiling/warm-up dummies). {how}",
    )


def _leading_dummies(rows: list[dict], positions: np.ndarray, batched: bool, min_dummy_rows: int) -> int:
    first = rows[0]["topk_ids"]
    run = 0
    while run < len(rows) and rows[run]["topk_ids"] == first:
        run += 1
    if run < min_dummy_rows:
        return 0
    if batched:  # the dummies are whole batches: cut where a batch starts
        while run < len(rows) and positions[run] != 0:
            run -= 1
    return run


def _batched_tokens(positions: np.ndarray, row_layers: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Token of every row and the first token of every forward pass.

    A call (one layer, one batch) starts where ``token_idx`` is 0; a forward pass starts
    with a call whose layer does not follow the previous call's.
    """
    tokens = np.empty_like(positions)
    forward_starts: list[int] = []
    base = width = 0
    previous_layer = None
    for index, position in enumerate(positions.tolist()):
        layer = int(row_layers[index])
        if position == 0 and (previous_layer is None or layer <= previous_layer):
            base += width
            width = 0
            forward_starts.append(base)
        if position == 0:
            previous_layer = layer
        tokens[index] = base + position
        width = max(width, position + 1)
    return tokens, forward_starts
