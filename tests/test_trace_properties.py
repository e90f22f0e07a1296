"""Property tests of every trace loader (hypothesis).

For each format: a routing with a known answer, rendered into the format, loads exactly
(or, sparser than the loaders allow, is refused); random and mutated files (truncated,
bytes inserted or replaced, non-UTF-8, a field deleted or given a wrong type, a huge or
negative index, a line repeated or moved) either load into a `RoutingTrace` that holds
exactly the file's records and round-trips through save/load, or raise ValueError naming
the file. Never another exception, never a wrong trace, and the memory a load takes stays
bounded however large a number the file claims.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from trace_formats import FORMATS, Truth, write_lines

from expertcache.trace import RoutingTrace, detect_format, load_trace

#: A few examples per run keep the suite fast; EXPERTCACHE_EXAMPLES=2000 searches deeper.
SETTINGS = settings(
    max_examples=int(os.environ.get("EXPERTCACHE_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
)

#: Most memory one load of these small files may take (a claim-sized array would be terabytes).
MEMORY_LIMIT = 32 * 2**20

_WEIRD_VALUES = [-1, -(2**63), 10**12, 2**70, 1.5, 2.0, True, False, None, "x", [], {}, [1.5], [True], [-1], [10**12]]


def load_bounded(path: Path) -> RoutingTrace:
    """``load_trace(path)``, asserting its peak traced memory stays under `MEMORY_LIMIT`."""
    tracemalloc.start()
    try:
        return load_trace(path)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < MEMORY_LIMIT, f"loading {path} took {peak} bytes"


def assert_same(trace: RoutingTrace, other: RoutingTrace) -> None:
    for name in ("expert_ids", "forward_starts", "request_starts", "layers"):
        left, right = getattr(trace, name), getattr(other, name)
        np.testing.assert_array_equal(left, right)
        assert left.dtype == right.dtype, name
    for name in ("num_experts", "model", "source", "notes"):
        assert getattr(trace, name) == getattr(other, name), name


def assert_round_trips(trace: RoutingTrace, folder: Path) -> None:
    """Saved without a suffix, the trace reads back identical (save writes exactly the path)."""
    written = trace.save(folder / "saved")
    assert written == folder / "saved" and written.is_file()
    assert_same(load_trace(written), trace)
    assert_same(RoutingTrace.load(written), trace)


def assert_holds_the_files_records(trace: RoutingTrace, path: Path) -> None:
    """Every record of the file is one cell of the trace, and every filled cell one record."""
    kind = detect_format(path)
    key = "topk_ids" if kind == "route_log" else "experts"
    lines = [json.loads(raw) for raw in path.read_bytes().splitlines() if raw.strip()]
    records = [tuple(line[key]) for line in lines if key in line]
    dropped = re.search(r"Dropped (\d+) leading", trace.notes)
    records = records[int(dropped.group(1)) :] if dropped else records
    ids = trace.expert_ids
    filled = (ids >= 0).all(axis=2)
    assert ((ids >= 0).any(axis=2) == filled).all(), "a record was padded or cut"
    assert Counter(map(tuple, ids[filled].tolist())) == Counter(records)
    assert trace.num_experts > int(ids.max())
    assert ids.dtype == (np.int16 if int(ids.max()) <= 32767 else np.int32)


def load_or_refuse(path: Path, folder: Path) -> RoutingTrace | None:
    """Load ``path``: a trace that round-trips, or a ValueError naming the file (then None)."""
    try:
        trace = load_bounded(path)
    except ValueError as error:
        assert str(path) in str(error), error
        assert "\n" not in str(error)
        event("refused")
        return None
    event("loaded")
    assert_round_trips(trace, folder)
    return trace


@pytest.mark.parametrize("name", sorted(FORMATS))
@SETTINGS
@given(data=st.data())
def test_a_known_routing_loads_exactly(name, data):
    truth: Truth = data.draw(FORMATS[name])
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        path = folder / "trace.jsonl"
        write_lines(path, truth.lines)
        assert detect_format(path) == name
        event("exact" if truth.dense_enough else "too sparse")
        if not truth.dense_enough:
            with pytest.raises(ValueError, match=re.escape(str(path)) + ".*dense"):
                load_bounded(path)
            return
        trace = load_bounded(path)
        np.testing.assert_array_equal(trace.expert_ids, truth.ids)
        assert trace.forward_starts.tolist() == truth.forward_starts
        assert trace.request_starts.tolist() == truth.request_starts
        assert trace.layers.tolist() == truth.layers
        assert trace.num_experts == truth.num_experts
        assert (f"Dropped {truth.dummies} " in trace.notes) == (name == "route_log")
        assert_holds_the_files_records(trace, path)
        assert_round_trips(trace, folder)


@st.composite
def _mutated_lines(draw, data: bytes) -> bytes:
    """``data`` (JSON lines) with one line changed, repeated, moved or removed."""
    lines = data.splitlines()
    index = draw(st.integers(0, len(lines) - 1))
    action = draw(st.sampled_from(["field", "repeat", "move", "remove"]))
    if action == "field":
        record = json.loads(lines[index])
        key = draw(st.sampled_from(sorted(record)))
        if draw(st.booleans()):
            del record[key]
        else:
            record[key] = draw(st.sampled_from(_WEIRD_VALUES))
        lines[index] = json.dumps(record).encode()
    elif action == "repeat":
        lines.insert(draw(st.integers(0, len(lines))), lines[index])
    elif action == "move":
        lines.insert(draw(st.integers(0, len(lines) - 1)), lines.pop(index))
    else:
        del lines[index]
    return b"\n".join(lines) + b"\n"


@st.composite
def _mutated_bytes(draw, data: bytes) -> bytes:
    """``data`` truncated, or with bytes inserted, replaced or deleted (non-UTF-8 among them)."""
    at = draw(st.integers(0, len(data)))
    action = draw(st.sampled_from(["truncate", "insert", "replace", "delete", "empty"]))
    noise = draw(
        st.sampled_from([b"\xff", b"\xc3", b"\n", b"{", b"]", b"\x00", b"-", b"9" * 30]) | st.binary(max_size=6)
    )
    if action == "truncate":
        return data[:at]
    if action == "insert":
        return data[:at] + noise + data[at:]
    if action == "replace":
        return data[:at] + noise + data[at + len(noise) :]
    if action == "delete":
        return data[:at] + data[at + draw(st.integers(1, 16)) :]
    return b""


@pytest.mark.parametrize("name", sorted(FORMATS))
@SETTINGS
@given(data=st.data())
def test_a_mutated_json_lines_file_loads_its_records_or_is_refused(name, data):
    truth: Truth = data.draw(FORMATS[name])
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        path = folder / "trace.jsonl"
        original = write_lines(path, truth.lines)
        mutate = _mutated_lines if data.draw(st.booleans()) else _mutated_bytes
        path.write_bytes(data.draw(mutate(original)))
        trace = load_or_refuse(path, folder)
        if trace is not None:
            assert_holds_the_files_records(trace, path)


_FIELDS = ["type", "top_k", "num_experts", "prompt_id", "problem_id", "token_pos", "token_idx", "layer",
           "experts", "topk_ids"]  # fmt: skip
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 12) | st.floats(allow_nan=True) | st.sampled_from(["meta", "route"]),
    lambda children: st.lists(children, max_size=3),
    max_leaves=6,
)


@SETTINGS
@given(
    lines=st.lists(st.dictionaries(st.sampled_from(_FIELDS), _JSON, min_size=1), min_size=1, max_size=6),
    suffix=st.sampled_from([".jsonl", ".npz", ""]),
)
def test_random_json_lines_load_their_records_or_are_refused(lines, suffix):
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        path = folder / f"random{suffix}"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        trace = load_or_refuse(path, folder)
        if trace is not None:
            assert_holds_the_files_records(trace, path)


@SETTINGS
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".jsonl", ".npz", ""]))
def test_random_bytes_are_refused_naming_the_file(data, suffix):
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / f"random{suffix}"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=re.escape(str(path))):
            load_bounded(path)


@st.composite
def traces(draw) -> RoutingTrace:
    """Any valid `RoutingTrace`: ids from -1 to beyond int16 (distinct in a record), starts, layers, text."""
    tokens, layers, top_k = draw(st.integers(0, 8)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    largest = draw(st.sampled_from([3, 32767, 32768, 2**31 - 2]))
    record = st.lists(st.integers(0, largest), min_size=top_k, max_size=top_k, unique=True)  # a router's top-k
    hidden = st.lists(st.booleans(), min_size=top_k, max_size=top_k)  # ids not logged (-1)
    ids = [
        -1 if gone else expert
        for _ in range(tokens * layers)
        for expert, gone in zip(draw(record), draw(hidden), strict=True)
    ]
    starts = sorted({0, *draw(st.sets(st.integers(1, max(tokens - 1, 1))))} & set(range(tokens)))
    requests = sorted(draw(st.sets(st.integers(0, max(tokens - 1, 0)))) & set(range(tokens)))
    text = st.text(max_size=12)
    return RoutingTrace(
        expert_ids=np.array(ids, dtype=np.int64).reshape(tokens, layers, top_k),
        forward_starts=starts,
        request_starts=requests,
        layers=sorted(draw(st.sets(st.integers(0, 2**40), min_size=layers, max_size=layers))),
        num_experts=draw(st.integers(max(ids, default=-1) + 1 or 1, 2**31 - 1)),  # ids may all be -1
        model=draw(text),
        source=draw(text),
        notes=draw(text),
    )


@SETTINGS
@given(trace=traces(), data=st.data())
def test_an_npz_round_trips_and_a_mutated_one_is_the_same_trace_or_refused(trace, data):
    assert trace.expert_ids.dtype == (np.int16 if trace.expert_ids.max(initial=-1) <= 32767 else np.int32)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        assert_round_trips(trace, folder)
        path = folder / "mutated.npz"
        path.write_bytes(data.draw(_mutated_bytes((folder / "saved").read_bytes())))
        loaded = load_or_refuse(path, folder)
        if loaded is not None:  # zip members carry a CRC: what loads is what was saved
            assert_same(loaded, trace)


@SETTINGS
@given(
    name=st.text(alphabet="abcxyz_-.", min_size=1, max_size=8).filter(lambda text: text not in (".", "..")),
    suffix=st.sampled_from([".jsonl", ".npz", ""]),
    inside=st.sampled_from([None, b"", b"not a trace", b"PK\x03\x04"]),
)
def test_a_directory_named_like_a_file_is_refused_naming_it(name, suffix, inside):
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / f"{name}{suffix}"
        path.mkdir()
        if inside is not None:  # a file that is no routing trace, inside it
            (path / "notes.txt").write_bytes(inside)
        with pytest.raises(ValueError, match=re.escape(str(path))):
            load_bounded(path)
        with pytest.raises(ValueError, match=re.escape(str(path)) + ": is a directory"):
            RoutingTrace.load(path)
