"""Loader for token-major per-layer records (local-moe-inference-stack, Qwen3-30B-A3B).

One JSON object per (token, layer), the layers of a token consecutive::

    {"prompt_id", "topic", "token_pos", "layer", "experts": [K]}

One token per forward pass (llama.cpp fed tokens one at a time); a new request starts
where ``prompt_id`` changes. The files in ``shared/traces`` are windows cut out of a
larger file: several windows load as one trace whose requests are the windows' prompts,
each window starting a request (`expertcache.trace.loaders.load_trace` on the folder).
The prompt/generation boundary is not recorded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from expertcache.trace.format import RoutingTrace
from expertcache.trace.jsonl import (
    build_trace,
    columns_of,
    empty_ids,
    infer_num_experts,
    missing_note,
    read_jsonl,
    require_records,
)
from expertcache.trace.records import RecordChecker


def load_layer_records(path: str | Path, *, num_experts: int | None = None, model: str = "") -> RoutingTrace:
    """Load one file of per-(token, layer) records.

    Tokens are numbered in order of first appearance of their ``(prompt_id, token_pos)``;
    columns are the distinct ``layer`` values in order.

    Returns:
        `RoutingTrace` with ``expert_ids`` ``[N, L, K]``, one forward per token.

    Raises:
        TraceFileError: a malformed record, or two records for one (token, layer).
    """
    checker = RecordChecker(path, num_experts=num_experts)
    token_of: dict[tuple[int | str, int], int] = {}
    request_starts: list[int] = []
    previous_prompt: object = None
    cells: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
    for line, record in read_jsonl(path):
        prompt = checker.identity(line, record, "prompt_id")
        key = (prompt, checker.index(line, record, "token_pos"))
        layer = checker.index(line, record, "layer")
        experts = checker.experts(line, record, "experts")
        if key not in token_of:
            if not token_of or prompt != previous_prompt:
                request_starts.append(len(token_of))
                previous_prompt = prompt
            token_of[key] = len(token_of)
        cell = (token_of[key], layer)
        if cell in cells:
            raise checker.fail(
                line,
                f"a second record for token_pos {key[1]} of prompt {prompt!r} at layer {layer} "
                f"(the first is line {cells[cell][0]})",
            )
        cells[cell] = (line, experts)
    require_records(path, cells)
    layers, column = columns_of(layer for _, layer in cells)
    assert checker.top_k is not None
    ids = empty_ids(path, len(token_of), len(layers), checker.top_k, len(cells))
    for (token, layer), (_, experts) in cells.items():
        ids[token, column[layer]] = experts
    return build_trace(
        path,
        expert_ids=ids,
        forward_starts=np.arange(len(token_of)),
        request_starts=np.asarray(request_starts, dtype=np.int64),
        layers=np.asarray(layers, dtype=np.int64),
        num_experts=infer_num_experts(ids, num_experts),
        model=model,
        source=str(path),
        notes=(
            f"One token per forward; request = prompt; prompt/generation boundary not recorded. {missing_note(ids)}"
        ).strip(),
    )
