"""`load_trace`: any routing trace the project knows, as a `RoutingTrace`.

Accepted inputs:

* a ``.npz`` written by `RoutingTrace.save` (the recorder's output);
* a ``.jsonl`` in one of the formats of ``shared/traces`` (see `detect_format`);
* a folder: every routing file in it, which must share one format, loaded in name order
  and concatenated (each file starts a request). Files that are not routing traces
  (``prompts.txt``, ``*_outputs.jsonl``) are skipped.

Each format's loader handles that format's known defects and states them in ``notes``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from expertcache.trace.format import RoutingTrace
from expertcache.trace.jsonl import concatenate
from expertcache.trace.layer_records import load_layer_records
from expertcache.trace.mixtral_logs import load_decode_routing, load_raw_routing_log
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
    """
    path = Path(path)
    if path.suffix != ".jsonl":
        return None
    with open(path, encoding="utf-8") as lines:
        first = lines.readline()
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
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


def load_trace(path: str | Path, *, num_experts: int | None = None) -> RoutingTrace:
    """Load ``path`` (``.npz``, ``.jsonl`` or a folder of one format) as a `RoutingTrace`.

    Args:
        path: the trace.
        num_experts: experts per layer when the file does not say (default: one more than
            the largest id seen).

    Raises:
        ValueError: unknown format, or a folder mixing formats.
    """
    path = Path(path)
    if path.is_dir():
        return _load_folder(path, num_experts)
    if path.suffix == ".npz":
        return RoutingTrace.load(path)
    kind = detect_format(path)
    if kind is None:
        raise ValueError(f"{path}: not a routing trace this project can read ({_known()})")
    return LOADERS[kind](path, num_experts=num_experts)


def _load_folder(folder: Path, num_experts: int | None) -> RoutingTrace:
    found = {file: detect_format(file) for file in sorted(folder.glob("*.jsonl"))}
    found = {file: kind for file, kind in found.items() if kind is not None}
    found.update({file: "npz" for file in sorted(folder.glob("*.npz"))})
    kinds = set(found.values())
    if not kinds:
        raise ValueError(f"{folder}: no routing trace inside ({_known()})")
    if len(kinds) > 1:
        listing = ", ".join(f"{file.name} ({kind})" for file, kind in found.items())
        raise ValueError(f"{folder} mixes trace formats; load one file: {listing}")
    traces = [load_trace(file, num_experts=num_experts) for file in found]
    if len(traces) == 1:
        return traces[0]
    names = ", ".join(file.name for file in found)
    return concatenate(traces, notes=f"{len(traces)} files concatenated ({names}).")


def _known() -> str:
    return "known: .npz, " + ", ".join(LOADERS) + " (.jsonl)"
