"""Routing for `bench_ep`: real decode sequences from a trace, replayed as per-rank batches.

Reads either a `RoutingTrace` ``.npz`` or the Qwen3-30B-A3B JSONL windows of
``<traces>/qwen3-30b-a3b-instruct-2507__local-moe-inference-stack/`` (one record per
token and layer: ``{"prompt_id", "topic", "token_pos", "layer", "experts": [8 ids]}``). The
JSONL reading here is deliberately minimal; once ``expertcache.trace.loaders`` lands it
can replace `read_jsonl_windows`. Traces are read, never copied into the package.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from expertcache.trace import RoutingTrace

QWEN3_TRACE = "qwen3-30b-a3b-instruct-2507__local-moe-inference-stack"  # under traces_dir()


def load_sequences(path: Path, min_tokens: int) -> tuple[list[np.ndarray], int]:
    """Decode sequences of a trace and its expert count.

    Returns:
        ``(sequences, num_experts)``: each sequence ``[N, L, K]`` int64 global ids, tokens
        in order; sequences shorter than ``min_tokens`` are dropped.
    """
    if path.is_dir():
        sequences, num_experts = read_jsonl_windows(path)
    else:
        trace = RoutingTrace.load(path)
        cuts = trace.request_starts[trace.request_starts > 0]
        sequences = np.split(trace.expert_ids.astype(np.int64), cuts)
        num_experts = trace.num_experts
    kept = [seq for seq in sequences if seq.shape[0] >= min_tokens]
    if not kept:
        raise ValueError(f"{path}: no sequence of at least {min_tokens} tokens")
    return kept, num_experts


def read_jsonl_windows(directory: Path) -> tuple[list[np.ndarray], int]:
    """One sequence per (window file, prompt) of the Qwen3 JSONL windows; 128 experts."""
    sequences = []
    for window in sorted(directory.glob("window_*.jsonl")):
        tokens: dict[tuple[int, int], list[list[int]]] = {}
        for line in window.read_text().splitlines():
            record = json.loads(line)
            layers = tokens.setdefault((record["prompt_id"], record["token_pos"]), [])
            if record["layer"] != len(layers):
                raise ValueError(f"{window}: layer {record['layer']} out of order")
            layers.append(record["experts"])
        by_prompt: dict[int, list[list[list[int]]]] = {}
        for (prompt, _), layers in tokens.items():
            by_prompt.setdefault(prompt, []).append(layers)
        sequences += [np.asarray(rows, dtype=np.int64) for rows in by_prompt.values()]
    if not sequences:
        raise FileNotFoundError(f"no window_*.jsonl in {directory}")
    return sequences, 128


def pick_columns(num_layers: int, count: int) -> list[int]:
    """``count`` layer columns spread evenly over ``num_layers`` (first and last included)."""
    return sorted(set(np.linspace(0, num_layers - 1, min(count, num_layers)).round().astype(int)))


class DecodeReplay:
    """Per-rank decode batches: rank ``r``'s batch row ``b`` follows one sequence.

    Row ``b`` of rank ``r`` plays sequence ``(r * B + b) % S`` from token 0, advancing one
    token per step and wrapping; when there are fewer sequences than rows, a repeated
    sequence starts 17 tokens later per repeat, so no two rows are in lockstep.
    """

    def __init__(self, sequences: list[np.ndarray], *, rank: int, tokens_per_rank: int) -> None:
        self.sequences = sequences
        self.rows = [rank * tokens_per_rank + b for b in range(tokens_per_rank)]

    def ids(self, step: int, column: int) -> np.ndarray:
        """``[B, K]`` int64 global ids of this rank's batch at ``step`` for one layer column."""
        out = []
        for row in self.rows:
            sequence = self.sequences[row % len(self.sequences)]
            start = 17 * (row // len(self.sequences))
            out.append(sequence[(start + step) % sequence.shape[0], column])
        return np.stack(out)
