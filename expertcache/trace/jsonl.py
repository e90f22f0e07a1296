"""Helpers the JSON-lines trace loaders share: reading records, sizing and filling ``[N, L, K]``.

Array sizes come from what the file contains, never from an index it claims: layers become
columns in sorted order (the `RoutingTrace.layers` keep their numbers), and an array may
have at most `CELLS_PER_RECORD` (token, layer) cells per record in the file, so a record
claiming ``token_pos`` 10**12 is refused instead of allocating terabytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence, Sized
from pathlib import Path

import numpy as np

from expertcache.trace.errors import TraceFileError
from expertcache.trace.format import RoutingTrace
from expertcache.trace.npz_file import check_readable_file

#: Most (token, layer) cells an array may have per record read: real traces are dense
#: (a few percent of records lost); far sparser means an index is wrong.
CELLS_PER_RECORD = 4

_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def json_type(value: object) -> str:
    """The JSON name of ``value``'s type (``null`` for None)."""
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` for every non-blank line of ``path``, each a JSON object.

    Raises:
        TraceFileError: missing, a directory, empty, a line that is not UTF-8, not JSON, or
            not an object. A UTF-8 byte-order mark opening the file is read past.
    """
    path = Path(path)
    check_readable_file(path)
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # an editor's BOM opens line 1
            except UnicodeDecodeError as error:
                raise TraceFileError(path, f"not UTF-8 text (byte {error.start} of the line)", line=number) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                reason = error.msg.removesuffix(" at")
                raise TraceFileError(path, f"not JSON ({reason}, column {error.colno})", line=number) from None
            except (ValueError, RecursionError) as error:  # a 5000-digit int, nesting too deep
                raise TraceFileError(path, f"not JSON that can be read ({error})", line=number) from None
            if not isinstance(record, dict):
                raise TraceFileError(path, f"expected a JSON object, got {json_type(record)}", line=number)
            yield number, record


def require_records(path: str | Path, records: Sized) -> None:
    """Raise `TraceFileError` when a file held no routing record."""
    if not records:
        raise TraceFileError(path, "no routing records")


def columns_of(layers: Iterable[int]) -> tuple[list[int], dict[int, int]]:
    """The distinct layers in order, and each one's column."""
    ordered = sorted(set(layers))
    return ordered, {layer: column for column, layer in enumerate(ordered)}


def empty_ids(path: str | Path, num_tokens: int, num_layers: int, top_k: int, num_records: int) -> np.ndarray:
    """``[N, L, K]`` int32 filled with -1 (no record), sized by what the file holds.

    Raises:
        TraceFileError: more than `CELLS_PER_RECORD` cells per record (an index is wrong).
    """
    cells = num_tokens * num_layers
    if cells > CELLS_PER_RECORD * num_records:
        raise TraceFileError(
            path,
            f"{num_records} records would spread over {num_tokens} tokens x {num_layers} layers; "
            f"a trace is dense (at most {CELLS_PER_RECORD} (token, layer) cells per record), so a "
            "token index in this file is wrong",
        )
    return np.full((num_tokens, num_layers, top_k), -1, dtype=np.int32)


def build_trace(path: str | Path, **fields: object) -> RoutingTrace:
    """``RoutingTrace(**fields)``, any inconsistency reported as a `TraceFileError` of ``path``."""
    try:
        return RoutingTrace(**fields)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        raise TraceFileError(path, f"does not make a valid routing trace: {error}") from None


def infer_num_experts(ids: np.ndarray, given: int | None) -> int:
    """``given``, else one more than the largest id recorded (the records were checked)."""
    if given is not None:
        return int(given)
    return int(ids.max()) + 1 if ids.size and int(ids.max()) >= 0 else 1


def missing_note(ids: np.ndarray) -> str:
    """How many (token, layer) records are absent, as a sentence for ``notes`` ("" if none)."""
    missing = int((ids < 0).all(axis=2).sum())
    if not missing:
        return ""
    total = ids.shape[0] * ids.shape[1]
    return f"{missing} of {total} (token, layer) records absent (expert_ids -1)."


def concatenate(traces: Sequence[RoutingTrace], *, notes: str = "", names: Sequence[str] | None = None) -> RoutingTrace:
    """Traces one after another: forward and request starts shift; each trace starts a request.

    All traces must have the same layers, and those that hold tokens the same top-k (an
    empty recording has none: it adds nothing). ``names`` name the traces in an error
    (default: their ``source``).
    """
    if not traces:
        raise ValueError("nothing to concatenate")
    names = [trace.source for trace in traces] if names is None else list(names)
    filled = [index for index, trace in enumerate(traces) if trace.num_tokens] or [0]
    first = traces[filled[0]]
    for index, trace in enumerate(traces):
        other_k = index in filled and trace.top_k != first.top_k
        if other_k or not np.array_equal(np.asarray(trace.layers), np.asarray(first.layers)):
            raise ValueError(
                f"traces disagree on layers or top-k: {names[index]} has layers {_span(trace.layers)} "
                f"top-{trace.top_k}, {names[filled[0]]} {_span(first.layers)} top-{first.top_k}"
            )
    kept = [traces[index] for index in filled]
    offsets = np.cumsum([0] + [trace.num_tokens for trace in kept[:-1]])
    request_starts = [np.append(trace.request_starts, 0) + offset for offset, trace in zip(offsets, kept, strict=True)]
    return RoutingTrace(
        expert_ids=np.concatenate([trace.expert_ids.astype(np.int32) for trace in kept]),
        forward_starts=np.concatenate(
            [trace.forward_starts + offset for offset, trace in zip(offsets, kept, strict=True)]
        ),
        request_starts=np.unique(np.concatenate(request_starts)) if first.num_tokens else np.zeros(0, np.int64),
        layers=first.layers,
        num_experts=max(trace.num_experts for trace in traces),
        model=first.model,
        source="; ".join(trace.source for trace in traces),
        notes=" ".join([notes, *dict.fromkeys(trace.notes for trace in traces)]).strip(),
    )


def _span(layers: np.ndarray | None) -> str:
    values = [] if layers is None else layers.tolist()
    return f"{values}" if len(values) <= 4 else f"[{values[0]}, ..., {values[-1]}] ({len(values)})"
