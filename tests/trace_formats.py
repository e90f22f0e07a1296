"""Hypothesis strategies for routings with a known answer, rendered into every trace format.

Each strategy draws a *truth* (the ``[N, L, K]`` ids, -1 where no record exists, plus the
forward and request structure) that its format can express without ambiguity, and the file
lines that say it. A loader given the file must return exactly the truth, or refuse a file
sparser than `expertcache.trace.jsonl.CELLS_PER_RECORD` allows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from expertcache.trace.jsonl import CELLS_PER_RECORD


@dataclass
class Truth:
    """What a file says. ``ids`` ``[N, L, K]`` int64, -1 = no record."""

    ids: np.ndarray
    layers: list[int]
    forward_starts: list[int]
    request_starts: list[int]
    num_experts: int
    lines: list[dict] = field(default_factory=list)
    dummies: int = 0

    @property
    def records(self) -> int:
        return int((self.ids >= 0).all(axis=2).sum())

    @property
    def dense_enough(self) -> bool:
        return self.ids.shape[0] * self.ids.shape[1] <= CELLS_PER_RECORD * self.records


def write_lines(path: Path, lines: list[dict]) -> bytes:
    """Write ``lines`` as JSON lines; return the bytes written."""
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    path.write_bytes(data)
    return data


@st.composite
def _cells(draw, *, max_tokens: int = 9, max_layers: int = 4, min_layers: int = 1):
    """Shape, ids of every cell, a presence mask, layer numbers and num_experts."""
    num_experts = draw(st.sampled_from([2, 3, 8, 40000]))  # 40000: ids beyond int16
    top_k = draw(st.integers(1, min(3, num_experts)))
    tokens = draw(st.integers(1, max_tokens))
    layers = draw(st.integers(min_layers, max_layers))
    row = st.lists(st.integers(0, num_experts - 1), min_size=top_k, max_size=top_k, unique=True)
    ids = np.array(draw(st.lists(row, min_size=tokens * layers, max_size=tokens * layers)), dtype=np.int64)
    ids = ids.reshape(tokens, layers, top_k)
    mask = np.array(draw(st.lists(st.booleans(), min_size=tokens * layers, max_size=tokens * layers)))
    numbers = sorted(draw(st.sets(st.integers(0, 60), min_size=layers, max_size=layers)))
    return ids, mask.reshape(tokens, layers), numbers, num_experts


def _apply(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    out = ids.copy()
    out[~mask] = -1
    return out


def _every_column_used(mask: np.ndarray) -> None:
    for column in range(mask.shape[1]):
        if not mask[:, column].any():
            mask[0, column] = True


def _rows(truth_ids: np.ndarray, token: int, column: int) -> list[int]:
    return [int(expert) for expert in truth_ids[token, column]]


@st.composite
def layer_records(draw) -> Truth:
    """Token-major ``{"prompt_id", "token_pos", "layer", "experts"}``, one token per forward."""
    ids, mask, layers, experts = draw(_cells())
    tokens = ids.shape[0]
    mask[:, 0] |= ~mask.any(axis=1)  # every token has a record
    _every_column_used(mask)
    ids = _apply(ids, mask)
    cuts = sorted(draw(st.sets(st.integers(1, max(tokens - 1, 1)), max_size=3))) if tokens > 1 else []
    starts = [0, *cuts]
    named = draw(st.booleans())  # prompt ids are ints or strings
    lines = []
    for token in range(tokens):
        request = max(index for index, start in enumerate(starts) if start <= token)
        prompt = f"prompt-{request}" if named else 100 + request
        for column, layer in enumerate(layers):
            if mask[token, column]:
                lines.append(
                    {"prompt_id": prompt, "topic": "t", "token_pos": token - starts[request], "layer": layer,
                     "experts": _rows(ids, token, column)}
                )  # fmt: skip
    return Truth(ids, layers, list(range(tokens)), starts, int(ids.max()) + 1, lines)  # no file says E


@st.composite
def raw_routing_log(draw) -> Truth:
    """A prefill (layer-major, ``token_pos`` 0..P-1), then decode steps (``token_pos`` 0); one layer too."""
    ids, mask, layers, experts = draw(_cells())
    tokens = ids.shape[0]
    prompt = draw(st.integers(1, tokens))
    mask[prompt - 1, -1] = True  # the prefill's last token, at the last layer: the prefill ends there
    mask[prompt:, 0] = True  # every decode step starts at the first layer (a step starts where layer drops)
    _every_column_used(mask)
    ids = _apply(ids, mask)
    lines = []
    for column, layer in enumerate(layers):
        for token in range(prompt):
            if mask[token, column]:
                lines.append(
                    {"problem_id": 0, "layer": layer, "token_pos": token, "experts": _rows(ids, token, column)}
                )
    for token in range(prompt, tokens):
        for column, layer in enumerate(layers):
            if mask[token, column]:
                lines.append({"problem_id": 0, "layer": layer, "token_pos": 0, "experts": _rows(ids, token, column)})
    return Truth(ids, layers, [0, *range(prompt, tokens)], [0], int(ids.max()) + 1, lines)


@st.composite
def decode_routing(draw) -> Truth:
    """Problems one after another; within a problem each layer's rows are a prefix, any order."""
    problems = draw(st.integers(1, 3))
    blocks, lines, starts, offset = [], [], [], 0
    _, _, layers, experts = draw(_cells(max_tokens=1))
    top_k = draw(st.integers(1, min(3, experts)))
    row = st.lists(st.integers(0, experts - 1), min_size=top_k, max_size=top_k, unique=True)
    for problem in range(problems):
        counts = [draw(st.integers(0, 4)) for _ in layers]
        counts[draw(st.integers(0, len(layers) - 1))] = length = max(max(counts), 1)
        block = np.full((length, len(layers), top_k), -1, dtype=np.int64)
        problem_lines = []
        for column, (layer, count) in enumerate(zip(layers, counts, strict=True)):
            for token in range(count):
                block[token, column] = draw(row)
                problem_lines.append(
                    {"dataset": "d", "problem_id": problem, "layer": layer, "experts": _rows(block, token, column),
                     "token_idx": token}
                )  # fmt: skip
        lines += draw(st.permutations(problem_lines))
        blocks.append(block)
        starts.append(offset)
        offset += length
    ids = np.concatenate(blocks)
    used = (ids >= 0).all(axis=2).any(axis=0)
    return Truth(ids[:, used], [layer for layer, keep in zip(layers, used, strict=True) if keep],
                 list(range(offset)), starts, int(ids.max()) + 1, lines)  # fmt: skip


@st.composite
def route_log(draw) -> Truth:
    """A vLLM profiler log: batched (``token_idx`` restarts per call) or a global counter."""
    ids, mask, layers, experts = draw(_cells())
    meta = {"type": "meta", "model_id": "m", "top_k": ids.shape[2]}
    if draw(st.booleans()):
        meta["num_experts"] = experts
    truth = draw(_batched(ids, mask, layers, experts) if draw(st.booleans()) else _counter(ids, mask, layers, experts))
    truth.lines.insert(0, meta)
    if "num_experts" not in meta:
        truth.num_experts = int(truth.ids.max()) + 1
    return truth


def _route(token_index: int, layer: int, experts: list[int]) -> dict:
    return {"type": "route", "req_id": "r", "token_idx": token_index, "layer": layer, "topk_ids": experts,
            "topk_weights": [0.5] * len(experts)}  # fmt: skip


@st.composite
def _counter(draw, ids, mask, layers, experts) -> Truth:
    tokens = ids.shape[0]
    mask[0, 0] = mask[-1, 0] = True  # the first and last token are seen
    _every_column_used(mask)
    ids = _apply(ids, mask)
    rows = [(token, column) for token in range(tokens) for column in range(len(layers)) if mask[token, column]]
    dummies = draw(st.sampled_from([0, 64, 70])) if experts > 1 else 0
    # a counter that starts at 0 with several layers would read as batched: start it later
    offset = dummies + (draw(st.integers(1, 5)) if len(layers) > 1 or dummies else draw(st.integers(0, 5)))
    first = _rows(ids, *rows[0])
    dummy = [(expert + 1) % experts for expert in first]  # one repeated row, unlike the first real one
    lines = [_route(index, layers[0], dummy) for index in range(dummies)]
    lines += [_route(offset + token, layers[column], _rows(ids, token, column)) for token, column in rows]
    return Truth(ids, layers, list(range(tokens)), [], experts, lines, dummies)


@st.composite
def _batched(draw, ids, mask, layers, experts) -> Truth:
    tokens = ids.shape[0]
    cuts = sorted(draw(st.sets(st.integers(1, max(tokens - 1, 1)), max_size=3))) if tokens > 1 else []
    if len(layers) == 1 and not cuts:  # one call alone reads as a counter: make two forwards
        if tokens == 1:
            ids, mask = np.concatenate([ids, ids]), np.concatenate([mask, mask])
            tokens = 2
        cuts = [tokens - 1]
    starts = [0, *cuts]
    ends = [*cuts, tokens]
    for start, end in zip(starts, ends, strict=True):
        mask[start, :] = True  # every call of a forward starts with token_idx 0
        mask[end - 1, 0] = True  # the forward's width is seen
    ids = _apply(ids, mask)
    lines = []
    for start, end in zip(starts, ends, strict=True):
        for column, layer in enumerate(layers):
            for token in range(start, end):
                if mask[token, column]:
                    lines.append(_route(token - start, layer, _rows(ids, token, column)))
    return Truth(ids, layers, starts, [], experts, lines)


#: Format name -> strategy.
FORMATS = {
    "layer_records": layer_records(),
    "raw_routing_log": raw_routing_log(),
    "decode_routing": decode_routing(),
    "route_log": route_log(),
}
