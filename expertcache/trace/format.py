"""`RoutingTrace`: the project's one format for expert-routing traces.

A trace is the router's choice for every token at every MoE layer::

    expert_ids      [N, L, K] int16   global expert id; -1 = no record (dropped or not logged);
                              (int32) int32 only when an id does not fit int16
    forward_starts  [F]       int64   token index where each forward pass (fused-MoE call) starts
    request_starts  [R]       int64   token index where each request starts (may be empty: unknown)
    layers          [L]       int64   model layer index of each column

plus metadata (model, num_experts, top_k, source, notes). Tokens are in execution order.
A trace is a value: frozen after its constructor checked it, its arrays read-only (make a
changed one with ``dataclasses.replace``, which checks again).
Stored as ``.npz`` with no pickled objects: metadata goes in as a JSON string. ``save``
writes exactly the path it is given (no ``.npz`` is appended) and returns it; ``load``
reads any file ``save`` wrote, whatever its name, and checks everything it reads (see
`expertcache.trace.npz_file`).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from expertcache.file_writes import write_files
from expertcache.trace.arrays import (
    MAX_EXPERTS,
    expert_id_array,
    first_repeat,
    index_array,
    strictly_increasing,
    whole_number,
)
from expertcache.trace.errors import TraceFileError
from expertcache.trace.npz_file import read_npz

FORMAT_VERSION = 1

_MEMBERS = ("expert_ids", "forward_starts", "request_starts", "layers", "meta")
_TEXT_FIELDS = ("model", "source", "notes")

#: What a loader writes in ``notes`` when a trace's rows are exact per layer but not the same
#: tokens across layers (records lost, then renumbered per layer): a pool shared by the
#: layers then sees calls that mix tokens of different steps (see `RoutingTrace.layers_aligned`).
UNALIGNED_LAYERS = "NOT aligned across layers"


@dataclass(frozen=True)
class RoutingTrace:
    """Expert routing of ``N`` tokens through ``L`` MoE layers, top-``K``.

    Attributes:
        expert_ids: ``[N, L, K]`` int16 (int32 if an id exceeds 32767), -1 where no record
            exists. Any integer array is accepted and narrowed; floats and bools are refused.
        forward_starts: ``[F]`` int64 increasing token indices, first 0: token ``i`` belongs
            to forward pass ``searchsorted(forward_starts, i, "right") - 1``.
        request_starts: ``[R]`` int64 increasing token indices where requests start (empty:
            unknown).
        layers: ``[L]`` int64 distinct model layer index of each column of ``expert_ids``.
        num_experts: experts per layer ``E`` (1 .. 2**31 - 1); every id is below it, and no
            record names an expert twice.
        model: model name.
        source: where the trace came from.
        notes: known defects and how they were handled.

    Raises:
        TypeError / ValueError: on construction, for any field of the wrong type or value.
        dataclasses.FrozenInstanceError: assigning or deleting a field after construction
            (the checks above ran on the values given); ValueError: writing into an array.
    """

    expert_ids: np.ndarray
    forward_starts: np.ndarray
    num_experts: int
    model: str = ""
    request_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    layers: np.ndarray | None = None
    source: str = ""
    notes: str = ""

    def __post_init__(self) -> None:
        num_experts = whole_number("num_experts", self.num_experts, minimum=1, maximum=MAX_EXPERTS)
        expert_ids = expert_id_array(self.expert_ids, num_experts)
        layers = np.arange(expert_ids.shape[1], dtype=np.int64) if self.layers is None else self.layers
        checked = {
            "num_experts": num_experts,
            "expert_ids": expert_ids,
            "forward_starts": index_array("forward_starts", self.forward_starts),
            "request_starts": index_array("request_starts", self.request_starts),
            "layers": index_array("layers", layers),
        }
        for name in _TEXT_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        for name, value in checked.items():
            if isinstance(value, np.ndarray):  # each a copy of the caller's: nobody else can write it
                value.flags.writeable = False
            object.__setattr__(self, name, value)  # frozen: the constructor's one way in
        self._validate()

    def _validate(self) -> None:
        tokens = self.num_tokens
        starts = self.forward_starts
        if tokens and (starts.size == 0 or starts[0] != 0):
            raise ValueError("forward_starts must begin with 0")
        if not tokens and starts.size:
            raise ValueError("forward_starts must be empty when there are no tokens")
        if starts.size and (not strictly_increasing(starts) or starts[-1] >= tokens):
            raise ValueError(f"forward_starts must be strictly increasing token indices below N ({tokens})")
        requests = self.request_starts
        if requests.size and (not strictly_increasing(requests) or requests[-1] >= tokens):
            raise ValueError(f"request_starts must be strictly increasing token indices below N ({tokens})")
        if tokens and self.top_k < 1:
            raise ValueError("expert_ids must have at least one id per record (K >= 1)")
        assert self.layers is not None
        if self.layers.shape != (self.num_layers,):
            raise ValueError(f"layers must have one entry per column ({self.num_layers}), got {self.layers.size}")
        if np.unique(self.layers).size != self.layers.size:
            raise ValueError(f"layers must be distinct, got {self.layers.tolist()}")
        repeat = first_repeat(self.expert_ids)
        if repeat is not None:
            record, expert = repeat
            token, column = divmod(record, self.num_layers)
            where = f"the record of token {token} at layer column {column}"
            raise ValueError(f"expert_ids repeats expert {expert} in {where}")

    @property
    def num_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    @property
    def num_forwards(self) -> int:
        return int(self.forward_starts.size)

    @property
    def layers_aligned(self) -> bool:
        """False when ``notes`` say the rows are not the same tokens across layers
        (`UNALIGNED_LAYERS`, as the Mixtral decode-only loader writes): replay per layer is
        exact, a pool shared by the layers only approximate."""
        return UNALIGNED_LAYERS not in self.notes

    @property
    def num_records(self) -> int:
        """(token, layer) cells that hold a record (not all -1)."""
        return int((self.expert_ids >= 0).any(axis=2).sum())

    def forward_slices(self) -> Iterator[slice]:
        """Token slices of the forward passes, in order."""
        ends = np.append(self.forward_starts[1:], self.num_tokens)
        for start, end in zip(self.forward_starts.tolist(), ends.tolist(), strict=True):
            yield slice(start, end)

    def calls(self, column: int) -> Iterator[np.ndarray]:
        """The fused-MoE calls of layer column ``column``: ``[T_f, K]`` ids per forward pass.

        Rows without a record (all -1) are dropped; each call keeps the row-major order.

        Raises:
            TypeError: ``column`` not an int. ValueError: not in ``[0, L)`` (a negative one
                would count from the end: another layer's calls). Both at the call, before
                anything is iterated.
        """
        if not self.num_layers:
            raise ValueError("the trace has no layer column")
        column = whole_number("column", column, minimum=0, maximum=self.num_layers - 1)
        return self._calls(column)

    def _calls(self, column: int) -> Iterator[np.ndarray]:
        for tokens in self.forward_slices():
            ids = self.expert_ids[tokens, column]
            yield ids[(ids >= 0).any(axis=1)]

    def save(self, path: str | Path) -> Path:
        """Write the trace as ``.npz`` (no pickle) to exactly ``path``, atomically.

        Returns:
            The path written (``path`` itself: no suffix is added).

        Raises:
            ValueError: the folder does not exist or ``path`` is a directory (nothing is
                written); OSError: the file system refused the write.
        """
        target = Path(path)
        if target.is_dir():
            raise ValueError(f"{target}: is a directory; give a file name for the trace")
        if not target.parent.is_dir():
            raise ValueError(f"{target}: the folder {target.parent} does not exist")
        meta = {"format_version": FORMAT_VERSION, "num_experts": self.num_experts}
        meta.update({name: getattr(self, name) for name in _TEXT_FIELDS})
        archive = io.BytesIO()
        np.savez_compressed(
            archive,
            expert_ids=self.expert_ids,
            forward_starts=self.forward_starts,
            request_starts=self.request_starts,
            layers=np.asarray(self.layers),
            meta=np.array(json.dumps(meta)),
        )
        write_files({target: archive.getvalue()})
        return target

    @classmethod
    def load(cls, path: str | Path, *, num_experts: int | None = None) -> RoutingTrace:
        """Read a trace written by `save`.

        Args:
            path: the file (any name).
            num_experts: experts per layer to use instead of the file's (every id must be
                below it).

        Raises:
            TypeError / ValueError: ``num_experts`` not an int in [1, 2**31 - 1] (before the
                file is read).
            TraceFileError (a ValueError): missing, not an ``.npz``, truncated, corrupt,
                pickled objects, wrong dtypes, inconsistent arrays or metadata, or an id
                at or above ``num_experts``.
        """
        if num_experts is not None:
            num_experts = whole_number("num_experts", num_experts, minimum=1, maximum=MAX_EXPERTS)
        path = Path(path)
        arrays = read_npz(path, _MEMBERS)
        meta = _read_meta(path, arrays.pop("meta"))
        if num_experts is not None:
            meta["num_experts"] = num_experts
        fields: dict[str, Any] = {**arrays, **meta}
        try:
            return cls(**fields)
        except (TypeError, ValueError) as error:
            raise TraceFileError(path, f"not a valid routing trace: {error}") from None


def _read_meta(path: Path, array: np.ndarray) -> dict:
    """``num_experts``, ``model``, ``source`` and ``notes`` from the ``meta`` member."""
    if array.shape != () or array.dtype.kind != "U":
        raise TraceFileError(path, f"member 'meta' must be one string, got {array.dtype} of shape {array.shape}")
    try:
        meta = json.loads(str(array[()]))
    except (ValueError, RecursionError) as error:
        raise TraceFileError(path, f"member 'meta' is not JSON ({error})") from None
    if not isinstance(meta, dict):
        raise TraceFileError(path, f"member 'meta' must be a JSON object, got {type(meta).__name__}")
    version = meta.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:  # not true or 1.0, which equal 1
        raise TraceFileError(
            path, f"unsupported trace format {meta.get('format_version')!r} (expected {FORMAT_VERSION})"
        )
    missing = [name for name in ("num_experts", *_TEXT_FIELDS) if name not in meta]
    if missing:
        raise TraceFileError(path, f"member 'meta' lacks {', '.join(missing)}")
    return {name: meta[name] for name in ("num_experts", *_TEXT_FIELDS)}
