"""`RoutingTrace`: the project's one format for expert-routing traces.

A trace is the router's choice for every token at every MoE layer::

    expert_ids      [N, L, K] int16   global expert id; -1 = no record (dropped or not logged)
    forward_starts  [F]       int64   token index where each forward pass (fused-MoE call) starts
    request_starts  [R]       int64   token index where each request starts (may be empty: unknown)
    layers          [L]       int64   model layer index of each column

plus metadata (model, num_experts, top_k, source, notes). Tokens are in execution order.
Stored as ``.npz`` with no pickled objects (``np.load(..., allow_pickle=False)`` reads it):
metadata goes in as a JSON string.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1


@dataclass
class RoutingTrace:
    """Expert routing of ``N`` tokens through ``L`` MoE layers, top-``K``.

    Attributes:
        expert_ids: ``[N, L, K]`` int16, -1 where no record exists.
        forward_starts: ``[F]`` int64 increasing token indices, first 0: token ``i`` belongs
            to forward pass ``searchsorted(forward_starts, i, "right") - 1``.
        request_starts: ``[R]`` int64 token indices where requests start (empty: unknown).
        layers: ``[L]`` int64 model layer index of each column of ``expert_ids``.
        num_experts: experts per layer ``E``.
        model: model name.
        source: where the trace came from.
        notes: known defects and how they were handled.
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
        self.expert_ids = np.asarray(self.expert_ids, dtype=np.int16)
        if self.expert_ids.ndim != 3:
            raise ValueError(f"expert_ids must be [N, L, K], got shape {self.expert_ids.shape}")
        self.forward_starts = np.asarray(self.forward_starts, dtype=np.int64)
        self.request_starts = np.asarray(self.request_starts, dtype=np.int64)
        if self.layers is None:
            self.layers = np.arange(self.num_layers, dtype=np.int64)
        self.layers = np.asarray(self.layers, dtype=np.int64)
        self._validate()

    def _validate(self) -> None:
        n = self.num_tokens
        starts = self.forward_starts
        if n and (starts.size == 0 or starts[0] != 0):
            raise ValueError("forward_starts must begin with 0")
        if starts.size and (np.any(np.diff(starts) <= 0) or starts[-1] >= max(n, 1)):
            raise ValueError("forward_starts must be strictly increasing token indices below N")
        ids = self.expert_ids
        if ids.size and (ids.min() < -1 or ids.max() >= self.num_experts):
            raise ValueError(f"expert_ids must be in [-1, {self.num_experts})")
        if self.layers is not None and self.layers.shape != (self.num_layers,):
            raise ValueError(f"layers must have one entry per column ({self.num_layers})")

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

    def forward_slices(self) -> Iterator[slice]:
        """Token slices of the forward passes, in order."""
        ends = np.append(self.forward_starts[1:], self.num_tokens)
        for start, end in zip(self.forward_starts.tolist(), ends.tolist(), strict=True):
            yield slice(start, end)

    def calls(self, column: int) -> Iterator[np.ndarray]:
        """The fused-MoE calls of layer column ``column``: ``[T_f, K]`` ids per forward pass.

        Rows without a record (all -1) are dropped; each call keeps the row-major order.
        """
        for tokens in self.forward_slices():
            ids = self.expert_ids[tokens, column]
            yield ids[(ids >= 0).any(axis=1)]

    def save(self, path: str | Path) -> None:
        """Write ``.npz`` (no pickle)."""
        meta = {
            "format_version": FORMAT_VERSION,
            "num_experts": self.num_experts,
            "model": self.model,
            "source": self.source,
            "notes": self.notes,
        }
        np.savez_compressed(
            path,
            expert_ids=self.expert_ids,
            forward_starts=self.forward_starts,
            request_starts=self.request_starts,
            layers=np.asarray(self.layers),
            meta=np.array(json.dumps(meta)),
        )

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        """Read a trace written by `save`."""
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"{path}: unsupported trace format {meta.get('format_version')}")
            return cls(
                expert_ids=data["expert_ids"],
                forward_starts=data["forward_starts"],
                request_starts=data["request_starts"],
                layers=data["layers"],
                num_experts=int(meta["num_experts"]),
                model=meta["model"],
                source=meta["source"],
                notes=meta["notes"],
            )
