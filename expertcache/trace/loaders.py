"""`load_trace`: any routing trace the project knows, as a `RoutingTrace`.

Accepted inputs:

* a file written by `RoutingTrace.save` (the recorder's output), whatever its name: an
  ``.npz`` is recognised by its content (a zip archive), not its suffix;
* a ``.jsonl`` in one of the formats of ``shared/traces`` (see `detect_format`);
* a folder: every routing file in it, which must share one format, loaded in name order
  and concatenated (each file starts a request). Files that are not routing traces
  (``prompts.txt``, ``*_outputs.jsonl``) are skipped; a folder whose routing files are of
  two formats (``shared/traces``' Mixtral one) is refused: name one file. So is a subfolder
  named like a trace file (``b.npz/``): a folder is never read recursively.

`trace_files` lists the files a path stands for, so a command can refuse to write over one.

Each format's loader handles that format's known defects and states them in ``notes``.
Anything wrong with a file raises `TraceFileError` (a ValueError) naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from expertcache.trace.arrays import MAX_EXPERTS, whole_number
from expertcache.trace.errors import TraceFileError
from expertcache.trace.format import RoutingTrace
from expertcache.trace.jsonl import concatenate
from expertcache.trace.layer_records import load_layer_records
from expertcache.trace.mixtral_logs import load_decode_routing, load_raw_routing_log
from expertcache.trace.npz_file import check_readable_file
from expertcache.trace.route_logs import load_route_log

#: Format name -> loader(path, num_experts=...) for JSON-lines traces.
LOADERS: dict[str, Callable[..., RoutingTrace]] = {
    "route_log": load_route_log,
    "raw_routing_log": load_raw_routing_log,
    "decode_routing": load_decode_routing,
    "layer_records": load_layer_records,
}


def detect_format(path: str | Path) -> str | None:
    """The format of a ``.jsonl`` routing file from its first record, or None if it is not one.

    ``route_log``: a ``{"type": "meta"}`` first line (vLLM expert profiler). Otherwise by
    keys: ``prompt_id`` + ``token_pos`` -> ``layer_records``; ``token_pos`` ->
    ``raw_routing_log``; ``token_idx`` + ``problem_id`` -> ``decode_routing``.

    Raises:
        TraceFileError: the file is missing, a directory, or its first line is not UTF-8
            (an empty file, or one whose first record is not a JSON object, gives None).
    """
    path = Path(path)
    if path.suffix != ".jsonl":
        return None
    record = _first_record(path)
    return None if record is None else _format_of(record)


def _first_record(path: Path) -> dict | None:
    """The first non-blank line of ``path`` as a JSON object, or None when it is not one."""
    if not path.exists():
        raise TraceFileError(path, "no such file")
    if path.is_dir():
        raise TraceFileError(path, "is a directory, not a trace file")
    with open(path, "rb") as lines:
        line = next((raw for raw in lines if raw.strip()), b"")
    try:
        text = line.decode("utf-8-sig")  # a byte-order mark (some editors write one) is no record
    except UnicodeDecodeError as error:
        raise TraceFileError(path, f"not UTF-8 text (byte {error.start} of the first line)") from None
    try:
        record = json.loads(text) if text.strip() else None
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _format_of(record: dict) -> str | None:
    if record.get("type") == "meta":
        return "route_log"
    if "experts" not in record or "layer" not in record:
        return None
    if "prompt_id" in record and "token_pos" in record:
        return "layer_records"
    if "token_pos" in record:
        return "raw_routing_log"
    if "token_idx" in record and "problem_id" in record:
        return "decode_routing"
    return None


def trace_files(path: str | Path) -> list[Path]:
    """The files `load_trace` reads for ``path``: itself, or a folder's routing files in name order.

    Raises:
        ValueError: an empty str (``Path("")`` is the current folder). TraceFileError (a
            ValueError): a folder with no routing trace or mixing formats.
    """
    if not str(path).strip():
        raise ValueError("the trace path is empty (it would name the current folder)")
    path = Path(path)
    return _routing_files(path) if path.is_dir() else [path]


def load_trace(path: str | Path, *, num_experts: int | None = None) -> RoutingTrace:
    """Load ``path`` (an ``.npz`` trace, a ``.jsonl`` or a folder of one format) as a `RoutingTrace`.

    Args:
        path: the trace.
        num_experts: experts per layer, in place of what the file says (or, where it says
            nothing, of one more than the largest id seen); every id must be below it.

    Raises:
        TypeError / ValueError: ``num_experts`` not a positive int.
        ValueError: an empty path (`trace_files`).
        TraceFileError (a ValueError): missing, unknown format, a folder mixing formats, or
            anything malformed in the file (named with its line where there is one).
    """
    if num_experts is not None:
        whole_number("num_experts", num_experts, minimum=1, maximum=MAX_EXPERTS)
    files = trace_files(path)
    path = Path(path)
    if path.is_dir():
        return _load_folder(path, files, num_experts)
    check_readable_file(path)
    with open(path, "rb") as file:
        if file.read(2) == b"PK":  # a zip archive: what RoutingTrace.save writes
            return RoutingTrace.load(path, num_experts=num_experts)
    if path.suffix == ".npz":
        return RoutingTrace.load(path, num_experts=num_experts)  # says why it is not one
    kind = detect_format(path)
    if kind is None:
        raise TraceFileError(path, f"not a routing trace this project can read: {_first_line_says(path)} ({_known()})")
    return LOADERS[kind](path, num_experts=num_experts)


def _first_line_says(path: Path) -> str:
    """Why ``path`` matched no format, from its suffix and first line."""
    if path.suffix != ".jsonl":
        return f"a suffix {path.suffix or '(none)'!r} that is neither .npz nor .jsonl"
    with open(path, "rb") as lines:
        line = next((raw for raw in lines if raw.strip()), b"")
    if not line:
        return "only blank lines"
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as error:
        return f"its first line is not JSON ({type(error).__name__})"
    if not isinstance(record, dict):
        return "its first line is not a JSON object"
    return f"its first record has the fields {sorted(record)[:8]}"


def _routing_files(folder: Path) -> list[Path]:
    """The routing files of ``folder``, of one format, in name order (a subfolder named like
    one, or a link to a folder, is refused: a folder's traces are never read recursively)."""
    for entry in sorted([*folder.glob("*.jsonl"), *folder.glob("*.npz")]):
        if entry.is_dir():
            raise TraceFileError(
                folder, f"{entry.name} is a folder; a folder of traces holds trace files only (load it on its own)"
            )
    formats = {file: detect_format(file) for file in sorted(folder.glob("*.jsonl"))}
    found = {file: kind for file, kind in formats.items() if kind is not None}
    found.update({file: "npz" for file in sorted(folder.glob("*.npz"))})
    kinds = set(found.values())
    if not kinds:
        raise TraceFileError(folder, f"a folder with no routing trace inside ({_known()})")
    if len(kinds) > 1:
        listing = ", ".join(f"{file.name} ({kind})" for file, kind in found.items())
        raise TraceFileError(folder, f"mixes trace formats; load one file: {listing}")
    return list(found)


def _load_folder(folder: Path, files: list[Path], num_experts: int | None) -> RoutingTrace:
    traces = [load_trace(file, num_experts=num_experts) for file in files]
    if len(traces) == 1:
        return traces[0]
    _refuse_other_models(folder, files, traces)
    names = ", ".join(file.name for file in files)
    try:
        notes = f"{len(traces)} files concatenated ({names})."
        return concatenate(traces, notes=notes, names=[file.name for file in files])
    except ValueError as error:
        raise TraceFileError(folder, str(error)) from None


def _refuse_other_models(folder: Path, files: list[Path], traces: list[RoutingTrace]) -> None:
    """Raise unless the traces are of one model: the same model name where they state one,
    and, for saved ``.npz`` traces (which always state it), the same experts per layer.

    A JSON-lines trace that does not state its experts counts to its largest id, so those
    counts may differ between the windows of one model (the largest is taken).
    """
    named = {file.name: trace.model for file, trace in zip(files, traces, strict=True) if trace.model}
    if len(set(named.values())) > 1:
        listing = ", ".join(f"{name} ({model!r:.40})" for name, model in named.items())
        raise TraceFileError(folder, f"holds the traces of different models; load one file: {listing}")
    stated = {file.name: trace.num_experts for file, trace in zip(files, traces, strict=True) if file.suffix == ".npz"}
    if len(set(stated.values())) > 1:
        listing = ", ".join(f"{name} ({count})" for name, count in stated.items())
        raise TraceFileError(folder, f"holds traces of different experts per layer; load one file: {listing}")


def _known() -> str:
    return "known: .npz, " + ", ".join(LOADERS) + " (.jsonl)"
