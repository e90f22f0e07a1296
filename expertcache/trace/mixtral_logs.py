"""Loaders for the two per-token routing logs of the speculative-moe project (Mixtral-8x7B).

``raw`` log (one prompt, execution order)::

    {"dataset", "problem_id", "layer", "token_pos", "experts": [K], "gating_probs": [K]}

prefill first, layer by layer (a run of ``token_pos`` 0..P-1 per layer), then one record
per layer per decode step with ``token_pos`` 0. The prefill ends at the first record that
goes back: to a lower ``layer``, or to ``token_pos`` 0 at the same layer (only a decode step
does that: each step of a log of one layer; a first step whose records below the prefill's
last layer were lost); a step starts whenever ``layer`` does not increase. ``decode``-only files::

    {"dataset", "problem_id", "layer", "experts": [K], "gating_probs": [K], "token_idx"}

grouped by (problem, layer), ``token_idx`` numbered per layer *after* records were lost.

Known defect of both: the logger skipped every token whose gate weights were exactly
[0.5, 0.5] (meant for padding, it also hit real bf16 ties): about 2.8% of the (token, layer)
records are missing. In the raw log a missing record is a -1 row at its exact place (a
decode step that lost every record, as a step of a one-layer log does with its one, leaves
no row). In the decode files the per-layer order is exact but the rows are *not aligned
across layers* after a loss, so only per-layer replay is faithful; each layer's rows are
laid down in order and padded with -1 at the end; the notes say so (`UNALIGNED_LAYERS`),
and a global-pool replay of such a trace warns.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from expertcache.trace.format import UNALIGNED_LAYERS, RoutingTrace
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

DROPPED_TIES = (
    "Records of tokens whose two gate weights tied at exactly [0.5, 0.5] were dropped by "
    "the recorder (about 2.8% of records)."
)

#: One raw-log record as read: (line, layer, token_pos, experts).
_Raw = tuple[int, int, int, tuple[int, ...]]


def load_raw_routing_log(path: str | Path, *, num_experts: int | None = None, model: str = "") -> RoutingTrace:
    """Load a raw prefill-then-decode log: forward 0 is the prefill, then one per step.

    Returns:
        `RoutingTrace` with ``expert_ids`` ``[P + steps, L, K]``, -1 where a record was lost.

    Raises:
        TraceFileError: a malformed record, or two prefill records for one (token, layer).
    """
    checker = RecordChecker(path, num_experts=num_experts)
    records = [_raw_record(checker, line, record) for line, record in read_jsonl(path)]
    require_records(path, records)
    layers = [layer for _, layer, _, _ in records]
    prefill_end = _prefill_end(records)
    prefill = records[:prefill_end]
    _refuse_repeats(checker, prefill)
    prompt_tokens = max(position for _, _, position, _ in prefill) + 1
    steps: list[list[_Raw]] = []
    for index in range(prefill_end, len(records)):
        if index == prefill_end or layers[index] <= layers[index - 1]:
            steps.append([])
        steps[-1].append(records[index])
    ordered, column = columns_of(layers)
    assert checker.top_k is not None
    ids = empty_ids(path, prompt_tokens + len(steps), len(ordered), checker.top_k, len(records))
    for _, layer, position, experts in prefill:
        ids[position, column[layer]] = experts
    for step, step_records in enumerate(steps):
        for _, layer, _, experts in step_records:
            ids[prompt_tokens + step, column[layer]] = experts
    return build_trace(
        path,
        expert_ids=ids,
        forward_starts=np.concatenate([[0], prompt_tokens + np.arange(len(steps))]).astype(np.int64),
        request_starts=np.zeros(1, np.int64),
        layers=np.asarray(ordered, dtype=np.int64),
        num_experts=infer_num_experts(ids, num_experts),
        model=model,
        source=str(path),
        notes=(
            f"Prefill of {prompt_tokens} tokens (one forward), then {len(steps)} decode steps. "
            f"{DROPPED_TIES} {missing_note(ids)}"
        ),
    )


def _prefill_end(records: list[_Raw]) -> int:
    """The index of the first decode record: the first that goes back to a lower layer, or to
    ``token_pos`` 0 at the layer before it (in the prefill a layer's positions only grow);
    ``len(records)`` when there is none."""
    for index in range(1, len(records)):
        (_, previous, _, _), (_, layer, position, _) = records[index - 1], records[index]
        if layer < previous or (layer == previous and position == 0):
            return index
    return len(records)


def _raw_record(checker: RecordChecker, line: int, record: dict) -> _Raw:
    layer, position = checker.index(line, record, "layer"), checker.index(line, record, "token_pos")
    return line, layer, position, checker.experts(line, record, "experts")


def _refuse_repeats(checker: RecordChecker, prefill: list[_Raw]) -> None:
    first_line: dict[tuple[int, int], int] = {}
    for line, layer, position, _ in prefill:
        if (position, layer) in first_line:
            first = first_line[(position, layer)]
            message = f"a second prefill record for token_pos {position} at layer {layer} (the first is line {first})"
            raise checker.fail(line, message)
        first_line[(position, layer)] = line


def load_decode_routing(path: str | Path, *, num_experts: int | None = None, model: str = "") -> RoutingTrace:
    """Load a decode-only file: one token per forward, problems one after another.

    Returns:
        `RoutingTrace`; rows are exact per layer but not aligned across layers (see notes).

    Raises:
        TraceFileError: a malformed record, or two records for one (problem, layer, token_idx).
    """
    checker = RecordChecker(path, num_experts=num_experts)
    per_layer: dict[tuple[int | str, int], dict[int, tuple[int, ...]]] = defaultdict(dict)
    problems: dict[int | str, None] = {}
    records = 0
    for line, record in read_jsonl(path):
        problem = checker.identity(line, record, "problem_id")
        layer = checker.index(line, record, "layer")
        token = checker.index(line, record, "token_idx")
        experts = checker.experts(line, record, "experts")
        rows = per_layer[(problem, layer)]
        if token in rows:
            raise checker.fail(line, f"a second record for token_idx {token} of problem {problem!r} at layer {layer}")
        rows[token] = experts
        problems.setdefault(problem)
        records += 1
    require_records(path, per_layer)
    ordered, column = columns_of(layer for _, layer in per_layer)
    lengths = {problem: 0 for problem in problems}
    for (problem, _), rows in per_layer.items():
        lengths[problem] = max(lengths[problem], len(rows))
    offsets = dict(zip(problems, np.cumsum([0, *lengths.values()])[:-1].tolist(), strict=True))
    assert checker.top_k is not None
    ids = empty_ids(path, sum(lengths.values()), len(ordered), checker.top_k, records)
    for (problem, layer), rows in per_layer.items():
        start = offsets[problem]
        ids[start : start + len(rows), column[layer]] = [rows[token] for token in sorted(rows)]
    return build_trace(
        path,
        expert_ids=ids,
        forward_starts=np.arange(ids.shape[0]),
        request_starts=np.array(list(offsets.values()), dtype=np.int64),
        layers=np.asarray(ordered, dtype=np.int64),
        num_experts=infer_num_experts(ids, num_experts),
        model=model,
        source=str(path),
        notes=(
            f"Decode only, one token per forward, {len(problems)} problems. {DROPPED_TIES} "
            f"Rows are exact per layer but {UNALIGNED_LAYERS} after a lost record "
            "(token_idx was renumbered per layer); per-layer replay is faithful, a global "
            f"pool is approximate. Shorter layers are padded with -1. {missing_note(ids)}"
        ),
    )
