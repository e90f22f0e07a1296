"""Helpers the trace loaders share: reading JSON lines and filling an ``[N, L, K]`` array."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from expertcache.trace.format import RoutingTrace


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Every non-empty line of ``path`` parsed as a JSON object."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None


def empty_ids(num_tokens: int, num_layers: int, top_k: int) -> np.ndarray:
    """``[N, L, K]`` int16 filled with -1 (no record)."""
    return np.full((num_tokens, num_layers, top_k), -1, dtype=np.int16)


def infer_num_experts(ids: np.ndarray, given: int | None) -> int:
    """``given``, else one more than the largest id recorded (raises if an id exceeds it)."""
    largest = int(ids.max()) if ids.size else -1
    if given is None:
        return largest + 1
    if largest >= given:
        raise ValueError(f"the trace has expert id {largest}, but num_experts is {given}")
    return int(given)


def missing_note(ids: np.ndarray) -> str:
    """How many (token, layer) records are absent, as a sentence for ``notes`` ("" if none)."""
    missing = int((ids < 0).all(axis=2).sum())
    if not missing:
        return ""
    total = ids.shape[0] * ids.shape[1]
    return f"{missing} of {total} (token, layer) records absent (expert_ids -1)."


def concatenate(traces: Sequence[RoutingTrace], *, notes: str = "") -> RoutingTrace:
    """Traces one after another: forward and request starts shift; each trace starts a request.

    All traces must have the same layers and top-k.
    """
    if not traces:
        raise ValueError("nothing to concatenate")
    first = traces[0]
    for trace in traces[1:]:
        if trace.expert_ids.shape[1:] != first.expert_ids.shape[1:]:
            raise ValueError("traces disagree on layers or top-k")
    offsets = np.cumsum([0] + [trace.num_tokens for trace in traces[:-1]])
    request_starts = []
    for offset, trace in zip(offsets, traces, strict=True):
        starts = trace.request_starts if trace.request_starts.size else np.zeros(1, np.int64)
        request_starts.append(starts + offset)
    return RoutingTrace(
        expert_ids=np.concatenate([trace.expert_ids for trace in traces]),
        forward_starts=np.concatenate(
            [trace.forward_starts + offset for offset, trace in zip(offsets, traces, strict=True)]
        ),
        request_starts=np.unique(np.concatenate(request_starts)),
        layers=first.layers,
        num_experts=max(trace.num_experts for trace in traces),
        model=first.model,
        source="; ".join(trace.source for trace in traces),
        notes=" ".join([notes, *dict.fromkeys(trace.notes for trace in traces)]).strip(),
    )
