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

Every line after the metadata must be a ``"route"`` record; a ``num_experts`` given to the
loader takes the place of the metadata's. ``layers_logged`` (both logs of ``shared/traces``
say ``[0]``), when the metadata has it, must name exactly the layers the route records
are of (dummies included): a log cut short or two logs run together is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from expertcache.trace.arrays import MAX_EXPERTS, whole_number
from expertcache.trace.errors import TraceFileError
from expertcache.trace.format import RoutingTrace
from expertcache.trace.jsonl import build_trace, columns_of, empty_ids, infer_num_experts, json_type, read_jsonl
from expertcache.trace.records import RecordChecker


def load_route_log(path: str | Path, *, num_experts: int | None = None, min_dummy_rows: int = 64) -> RoutingTrace:
    """Load a route log; drop the leading profiling dummies.

    Returns:
        `RoutingTrace` with ``expert_ids`` ``[N, L, K]`` (``L`` = layers logged).

    Raises:
        TraceFileError: no or malformed metadata, a malformed record, route records of other
            layers than the metadata's ``layers_logged``, or two records for one (token, layer).
    """
    lines = read_jsonl(path)
    head = next(lines, None)
    checker, meta = _read_meta(path, head, num_experts)
    rows = _Rows(checker, lines)
    _check_layers_logged(checker, head, rows.layers)
    batched = 0 in rows.positions[1:]
    dummies = _leading_dummies(rows.experts, rows.positions, batched, min_dummy_rows)
    if dummies == len(rows.experts):
        raise TraceFileError(path, f"all {dummies} route records are one repeated row (profiling dummies)")
    rows.drop(dummies)
    ordered, column = columns_of(rows.layers)
    row_layers = [column[layer] for layer in rows.layers]
    if batched:
        tokens, starts = _batched_tokens(checker, rows, row_layers)
        how = (
            f"{len(starts)} forward batches from token_idx restarts; request boundaries inside a batch are not logged."
        )
    else:
        first = min(rows.positions)
        tokens, starts = [position - first for position in rows.positions], None
        how = "No batch or request boundaries: every token is taken as its own forward pass."
    num_tokens = max(tokens) + 1
    ids = empty_ids(path, num_tokens, len(ordered), checker.top_k or 1, len(rows.experts))  # refuses a sparse file
    token_array, layer_array = np.array(tokens, dtype=np.int64), np.array(row_layers, dtype=np.int64)
    _refuse_repeats(checker, token_array * len(ordered) + layer_array, rows.numbers)
    ids[token_array, layer_array] = rows.experts
    return build_trace(
        path,
        expert_ids=ids,
        forward_starts=np.arange(num_tokens) if starts is None else np.asarray(starts, dtype=np.int64),
        num_experts=infer_num_experts(ids, checker.num_experts),
        model=meta.get("model_id", ""),
        layers=np.asarray(ordered, dtype=np.int64),
        source=str(path),
        notes=f"Dropped {dummies} leading identical rows (vLLM profiling/warm-up dummies). {how}",
    )


class _Rows:
    """The checked route records of a log, field by field, with their line numbers."""

    def __init__(self, checker: RecordChecker, lines: Iterator[tuple[int, dict]]) -> None:
        self.numbers: list[int] = []
        self.positions: list[int] = []
        self.layers: list[int] = []
        self.experts: list[tuple[int, ...]] = []
        for line, record in lines:
            if record.get("type") != "route":
                raise checker.fail(line, f"expected a route record, got type {record.get('type')!r:.40}")
            self.numbers.append(line)
            self.positions.append(checker.index(line, record, "token_idx"))
            self.layers.append(checker.index(line, record, "layer"))
            self.experts.append(checker.experts(line, record, "topk_ids"))
        if not self.experts:
            raise TraceFileError(checker.path, "no route records")

    def drop(self, count: int) -> None:
        """Forget the first ``count`` rows."""
        for name in ("numbers", "positions", "layers", "experts"):
            setattr(self, name, getattr(self, name)[count:])


def _read_meta(path: str | Path, first: tuple[int, dict] | None, num_experts: int | None) -> tuple[RecordChecker, dict]:
    """A checker set up from the meta record (top-k; num_experts unless given), and the record."""
    if first is None or first[1].get("type") != "meta":
        raise TraceFileError(path, 'the first record is not a route-log meta record ({"type": "meta", ...})')
    line, meta = first
    checker = RecordChecker(path, num_experts=num_experts)
    try:
        checker.top_k = whole_number("top_k", checker.field(line, meta, "top_k"), minimum=1, maximum=MAX_EXPERTS)
        if num_experts is None and meta.get("num_experts") is not None:
            checker.num_experts = whole_number("num_experts", meta["num_experts"], minimum=1, maximum=MAX_EXPERTS)
    except TraceFileError:
        raise
    except (TypeError, ValueError) as error:
        raise checker.fail(line, f"meta record: {error}") from None
    if not isinstance(meta.get("model_id", ""), str):
        raise checker.fail(line, f"meta record: 'model_id' must be a string, got {json_type(meta['model_id'])}")
    if "topk_ids" in meta:  # a route record run into the meta line: its routing would be lost
        raise checker.fail(line, "meta record: it holds 'topk_ids', a route record's field (two records run together?)")
    return checker, meta


def _check_layers_logged(checker: RecordChecker, first: tuple[int, dict] | None, layers: list[int]) -> None:
    """Raise unless the meta record's ``layers_logged`` (where it has one) names the layers of the rows."""
    assert first is not None  # _read_meta has refused a log without a meta record
    line, meta = first
    declared = meta.get("layers_logged")
    if declared is None:
        return
    if not isinstance(declared, list) or not all(type(layer) is int for layer in declared):
        got = f"{json_type(declared)} {declared!r:.40}"
        raise checker.fail(line, f"meta record: 'layers_logged' must be a list of layer numbers, got {got}")
    found = sorted(set(layers))
    if sorted(set(declared)) != found:
        raise checker.fail(
            line, f"meta record: 'layers_logged' is {declared!r:.60} but the route records are of layers {found!r:.60}"
        )


def _refuse_repeats(checker: RecordChecker, cells: np.ndarray, numbers: list[int]) -> None:
    """Raise at the first row whose (token, layer) cell an earlier row already filled."""
    if np.unique(cells).size == cells.size:
        return
    seen: dict[int, int] = {}
    for index, cell in enumerate(cells.tolist()):
        if cell in seen:
            first = numbers[seen[cell]]
            raise checker.fail(
                numbers[index], f"a second record for the same token and layer (the first is line {first})"
            )
        seen[cell] = index


def _leading_dummies(experts: list[tuple[int, ...]], positions: list[int], batched: bool, min_dummy_rows: int) -> int:
    first = experts[0]
    run = 0
    while run < len(experts) and experts[run] == first:
        run += 1
    if run < min_dummy_rows:
        return 0
    if batched:  # the dummies are whole batches: cut where a batch starts
        while 0 < run < len(experts) and positions[run] != 0:
            run -= 1
    return run


def _batched_tokens(checker: RecordChecker, rows: _Rows, row_layers: list[int]) -> tuple[list[int], list[int]]:
    """Token of every row and the first token of every forward pass.

    A call (one layer, one batch) starts where ``token_idx`` is 0; a forward pass starts
    with a call whose layer does not follow the previous call's.
    """
    if rows.positions[0] != 0:
        first = rows.positions[0]
        raise checker.fail(rows.numbers[0], f"token_idx restarts at 0 in this log: the first must be 0, got {first}")
    tokens: list[int] = []
    forward_starts: list[int] = []
    base = width = 0
    previous_layer = None
    for position, layer in zip(rows.positions, row_layers, strict=True):
        if position == 0 and (previous_layer is None or layer <= previous_layer):
            base += width
            width = 0
            forward_starts.append(base)
        if position == 0:
            previous_layer = layer
        tokens.append(base + position)
        width = max(width, position + 1)
    return tokens, forward_starts
