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
from expertcache.trace.jsonl import empty_ids, infer_num_experts, missing_note, read_jsonl


def load_layer_records(path: str | Path, *, num_experts: int | None = None, model: str = "") -> RoutingTrace:
    """Load one file of per-(token, layer) records.

    Returns:
        `RoutingTrace` with ``expert_ids`` ``[N, L, K]``, one forward per token.
    """
    records = list(read_jsonl(path))
    if not records:
        raise ValueError(f"{path}: empty")
    token_of: dict[tuple[int, int], int] = {}
    request_starts: list[int] = []
    previous_prompt = None
    for record in records:
        key = (int(record["prompt_id"]), int(record["token_pos"]))
        if key not in token_of:
            if key[0] != previous_prompt:
                request_starts.append(len(token_of))
                previous_prompt = key[0]
            token_of[key] = len(token_of)
    num_layers = max(int(record["layer"]) for record in records) + 1
    ids = empty_ids(len(token_of), num_layers, len(records[0]["experts"]))
    for record in records:
        token = token_of[(int(record["prompt_id"]), int(record["token_pos"]))]
        ids[token, int(record["layer"])] = record["experts"]
    return RoutingTrace(
        expert_ids=ids,
        forward_starts=np.arange(len(token_of)),
        request_starts=np.asarray(request_starts, dtype=np.int64),
        num_experts=infer_num_experts(ids, num_experts),
        model=model,
        source=str(path),
        notes=(
            f"One token per forward; request = prompt; prompt/generation boundary not recorded. {missing_note(ids)}"
        ).strip(),
    )
