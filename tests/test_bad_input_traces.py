"""Bad trace input, case by case: each is refused with a message naming the file, the line
and the field (or loads exactly, for the edge cases that are valid), and changes nothing.

The property tests (``test_trace_properties.py``) search the same space at random; this
table pins the classes the issue names: ids beyond int16, negative indices, short or float
or bool id lists, ``num_experts=`` for every format, save/load paths, malformed ``.npz``,
claimed sizes that would allocate terabytes.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trace_properties import load_bounded

from expertcache.trace import RoutingRecorder, RoutingTrace, detect_format, load_trace
from expertcache.trace.errors import TraceFileError


def _record(**fields) -> dict:
    """A layer_records line (Qwen3 windows), fields overridden."""
    return {"prompt_id": 1, "topic": "t", "token_pos": 0, "layer": 0, "experts": [1, 2], **fields}


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "second, message",
    [
        (_record(layer=-1), "'layer' must be a non-negative integer, got -1"),  # wrapped around before
        (_record(token_pos=-3), "'token_pos' must be a non-negative integer, got -3"),
        (_record(layer=1.5), "'layer' must be a non-negative integer, got number 1.5"),
        (_record(layer=True), "'layer' must be a non-negative integer, got boolean True"),
        (_record(token_pos="3"), "'token_pos' must be a non-negative integer, got string '3'"),
        (_record(layer=2**70), "'layer' must be below 2\\*\\*63, got 1180591620717411303424"),
        (
            _record(experts=[1]),
            "'experts' must hold exactly 2 expert ids \\(top-k\\), got 1",
        ),  # was padded by repeating
        (_record(experts=[1, 2, 3]), "'experts' must hold exactly 2 expert ids \\(top-k\\), got 3"),
        (_record(experts=[1.0, 2]), "'experts' must hold integer expert ids, got number 1.0"),  # was truncated
        (_record(experts=[True, 2]), "'experts' must hold integer expert ids, got boolean True"),
        (_record(experts=[1, 1]), "'experts' repeats an expert id: \\[1, 1\\]"),
        (_record(experts=[-1, 2]), "'experts' holds expert id -1, out of range \\(ids must be below 2147483647\\)"),
        (_record(experts="1 2"), "'experts' must be a list of expert ids, got string"),
        (_record(prompt_id=[1]), "'prompt_id' must be an integer or a string, got array"),
        ({"prompt_id": 1, "token_pos": 1, "layer": 0}, "missing field 'experts'"),
        (_record(), "a second record for token_pos 0 of prompt 1 at layer 0 \\(the first is line 1\\)"),
        ([1, 2], "expected a JSON object, got array"),
        ('{"prompt_id": 1, "token_pos": 1, "lay', "not JSON \\(Invalid control character, column 38\\)"),
        ("1" * 5000, "not JSON that can be read \\(Exceeds the limit"),  # beyond Python's int digits limit
        ("[" * 100000, "not JSON that can be read \\(maximum recursion depth"),  # nesting too deep
    ],
)
def test_a_bad_record_is_refused_naming_file_line_and_field(tmp_path, second, message):
    path = _write(tmp_path / "t.jsonl", [_record(), second])
    with pytest.raises(TraceFileError, match=re.escape(f"{path}:2: ") + message):
        load_trace(path)


def test_ids_beyond_int16_are_kept_exactly_as_int32(tmp_path):
    path = _write(tmp_path / "t.jsonl", [_record(experts=[65537, 2])])  # int16 made this 1
    trace = load_trace(path)
    assert trace.expert_ids.dtype == np.int32 and trace.expert_ids.tolist() == [[[65537, 2]]]
    assert trace.num_experts == 65538
    assert load_trace(trace.save(tmp_path / "t.npz")).expert_ids.tolist() == [[[65537, 2]]]
    small = RoutingTrace(np.array([[[1, 2]]]), [0], num_experts=4)
    assert small.expert_ids.dtype == np.int16


@pytest.mark.parametrize("index", ["token_pos", "token_idx"])
def test_a_huge_token_index_is_refused_without_allocating(tmp_path, index):
    if index == "token_pos":  # the raw Mixtral log: token_pos is the prefill position
        lines = [{"problem_id": 0, "layer": 0, "token_pos": pos, "experts": [1, 2]} for pos in (0, 10**12)]
    else:  # a route log with a global counter
        lines = [{"type": "meta", "top_k": 2}] + [
            {"type": "route", "token_idx": pos, "layer": 0, "topk_ids": [1, 2]} for pos in (1, 10**12)
        ]
    path = _write(tmp_path / "t.jsonl", lines)
    with pytest.raises(TraceFileError, match="2 records would spread over 10{11}\\d tokens x 1 layers"):
        load_bounded(path)


def test_a_huge_prompt_position_is_only_a_name(tmp_path):
    """In layer_records a token is named by (prompt_id, token_pos): huge positions take no room."""
    trace = load_bounded(_write(tmp_path / "t.jsonl", [_record(), _record(token_pos=10**12)]))
    assert trace.expert_ids.shape == (2, 1, 2)


def test_a_huge_layer_number_becomes_a_column_not_an_allocation(tmp_path):
    path = _write(tmp_path / "t.jsonl", [_record(), _record(layer=10**12)])
    trace = load_bounded(path)
    assert trace.layers.tolist() == [0, 10**12] and trace.expert_ids.shape == (1, 2, 2)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty file"),
        (json.dumps(_record()).encode() + b"\n\xff\xfe\n", ":2: not UTF-8 text \\(byte 0 of the line\\)"),
        (b"\xff" + json.dumps(_record()).encode(), "not UTF-8 text"),
        (b"\n  \n", "not a routing trace this project can read"),
        (b'{"hello": 1}\n', "not a routing trace this project can read"),
        (b"PK\x03\x04 not really a zip", "truncated or corrupt archive"),
    ],
)
def test_malformed_json_lines_files(tmp_path, content, message):
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceFileError, match=re.escape(str(path)) + ".*" + message):
        load_trace(path)


def test_missing_files_and_directories_named_like_files(tmp_path):
    with pytest.raises(TraceFileError, match="nowhere.npz: no such file"):
        load_trace(tmp_path / "nowhere.npz")
    with pytest.raises(TraceFileError, match="nowhere.jsonl: no such file"):
        load_trace(tmp_path / "nowhere.jsonl")
    for name in ("d.npz", "d.jsonl"):
        (tmp_path / name).mkdir()
        with pytest.raises(TraceFileError, match=f"{name}: a folder with no routing trace inside"):
            load_trace(tmp_path / name)
    with pytest.raises(TraceFileError, match="d.npz: is a directory"):
        RoutingTrace.load(tmp_path / "d.npz")
    with pytest.raises(TraceFileError, match="d.jsonl: is a directory"):
        detect_format(tmp_path / "d.jsonl")


def _route_log(path: Path, meta: dict, rows: list) -> Path:
    routes = [{"type": "route", "token_idx": i, "layer": 0, "topk_ids": ids} for i, ids in enumerate(rows)]
    return _write(path, [{"type": "meta", **meta}, *routes])


@pytest.mark.parametrize(
    "meta, extra, message",
    [
        ({"top_k": "2"}, [], "r.jsonl:1: meta record: top_k must be an int, got str"),
        ({"top_k": 2, "num_experts": 0}, [], "meta record: num_experts must be in \\[1, "),
        ({"top_k": 2, "model_id": 5}, [], "'model_id' must be a string"),
        # a route record run into the meta line (found by test_trace_properties' mutations)
        ({"top_k": 2, "req_id": "r", "topk_ids": [0, 1]}, [], "r.jsonl:1: meta record: it holds 'topk_ids'"),
        ({"top_k": 2}, [{"type": "other"}], "r.jsonl:4: expected a route record, got type 'other'"),
        (
            {"top_k": 2, "num_experts": 3},
            [],
            "r.jsonl:3: 'topk_ids' holds expert id 3, out of range \\(num_experts is 3\\)",
        ),
    ],
)
def test_bad_route_logs(tmp_path, meta, extra, message):
    path = _route_log(tmp_path / "r.jsonl", meta, [[0, 1], [2, 3]])
    if extra:
        path.write_text(path.read_text() + "".join(json.dumps(line) + "\n" for line in extra))
    with pytest.raises(TraceFileError, match=message):
        load_trace(path)


def test_a_route_log_without_meta(tmp_path):
    path = _write(tmp_path / "r.jsonl", [{"type": "route", "token_idx": 0, "layer": 0, "topk_ids": [1]}])
    with pytest.raises(TraceFileError, match="not a routing trace"):  # no meta: no known format
        load_trace(path)


def _every_format(folder: Path) -> dict[str, Path]:
    """One small file per format, ids up to 3 (the .npz says num_experts 8)."""
    raw = [{"problem_id": 0, "layer": layer, "token_pos": 0, "experts": [layer, 3]} for layer in (0, 1)]
    decode = [{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [0, 3]}]
    files = {
        "layer_records": _write(folder / "a.jsonl", [_record(experts=[0, 3])]),
        "raw_routing_log": _write(folder / "b.jsonl", raw),
        "decode_routing": _write(folder / "c.jsonl", decode),
        "route_log": _route_log(folder / "d.jsonl", {"top_k": 2, "num_experts": 8}, [[0, 3], [1, 2]]),
    }
    files["npz"] = RoutingTrace(np.array([[[0, 3]]]), [0], num_experts=8).save(folder / "e.npz")
    return files


def test_a_num_experts_override_is_honoured_for_every_format_or_refused(tmp_path):
    for kind, path in _every_format(tmp_path).items():
        assert load_trace(path, num_experts=16).num_experts == 16, kind
        assert load_trace(path, num_experts=4).num_experts == 4, kind  # the npz and route log said 8
        with pytest.raises(TraceFileError, match=re.escape(str(path)) + ".*(out of range|must be in)"):
            load_trace(path, num_experts=3)  # id 3 is in every file
    with pytest.raises(TypeError, match="num_experts must be an int"):
        load_trace(tmp_path / "a.jsonl", num_experts=4.0)
    with pytest.raises(ValueError, match="num_experts must be in"):
        load_trace(tmp_path / "a.jsonl", num_experts=0)


def test_save_writes_exactly_the_path_given_and_load_reads_it(tmp_path):
    trace = RoutingTrace(np.array([[[0, 1]], [[1, 2]]]), [0, 1], num_experts=3, model="m")
    for name in ("t", "t.npz", "t.trace", "t.jsonl.npz"):
        written = trace.save(tmp_path / name)
        assert written == tmp_path / name and written.is_file()
        assert RoutingTrace.load(written).expert_ids.tolist() == trace.expert_ids.tolist()
        assert load_trace(written).model == "m"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["t", "t.jsonl.npz", "t.npz", "t.trace"]
    with pytest.raises(ValueError, match="the folder .*missing does not exist"):
        trace.save(tmp_path / "missing" / "t.npz")
    with pytest.raises(ValueError, match="is a directory"):
        trace.save(tmp_path)
    assert not (tmp_path / "missing").exists()


def _npz(path: Path, **overrides) -> Path:
    """A valid trace archive with members replaced (None: left out)."""
    members = {
        "expert_ids": np.array([[[0, 1]]], dtype=np.int16),
        "forward_starts": np.array([0]),
        "request_starts": np.array([0]),
        "layers": np.array([0]),
        "meta": np.array(json.dumps({"format_version": 1, "num_experts": 4, "model": "", "source": "", "notes": ""})),
        **overrides,
    }
    np.savez(path, **{name: value for name, value in members.items() if value is not None}, allow_pickle=True)
    return path


def _meta(**fields) -> np.ndarray:
    return np.array(
        json.dumps({"format_version": 1, "num_experts": 4, "model": "", "source": "", "notes": "", **fields})
    )


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _claiming(path: Path, shape: tuple[int, ...]) -> Path:
    """An archive whose expert_ids header claims ``shape`` but holds 4 bytes."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i2", "fortran_order": False, "shape": shape})
    _npz(path)
    with zipfile.ZipFile(path) as archive:
        others = {name: archive.read(name) for name in archive.namelist() if name != "expert_ids.npy"}
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("expert_ids.npy", header.getvalue() + b"\x00\x00\x01\x00")
        for name, data in others.items():
            archive.writestr(name, data)
    return path


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda p: _bytes(p, b"expert_ids,layers\n1,2\n"), "not an .npz archive"),  # was "pickled data"
        (lambda p: _bytes(p, _npz(p).read_bytes()[:-30]), "truncated or corrupt archive"),
        (lambda p: _npz(p, expert_ids=np.array([[[0, 1]]], dtype=object)), "pickled Python objects"),
        (lambda p: _npz(p, layers=None), "no member layers"),
        (lambda p: _npz(p, expert_ids=np.array([[[0.0, 1.7]]])), "expert_ids must hold integers, got dtype float64"),
        (lambda p: _npz(p, expert_ids=np.array([[[True, False]]])), "must hold integers, got dtype bool"),
        (lambda p: _npz(p, expert_ids=np.array([[[0, 9]]])), "must be in \\[-1, 4\\)"),
        (lambda p: _npz(p, expert_ids=np.array([[0, 1]])), "must be \\[N, L, K\\]"),
        (lambda p: _npz(p, forward_starts=np.array([1])), "forward_starts must begin with 0"),
        (lambda p: _npz(p, layers=np.array([0, 1])), "layers must have one entry per column"),
        (lambda p: _npz(p, meta=np.array("{not json")), "member 'meta' is not JSON"),
        (lambda p: _npz(p, meta=np.array([1, 2])), "member 'meta' must be one string"),
        (lambda p: _npz(p, meta=_meta(format_version=7)), "unsupported trace format 7"),
        (lambda p: _npz(p, meta=np.array(json.dumps({"format_version": 1}))), "lacks num_experts, model"),
        (lambda p: _npz(p, meta=_meta(num_experts="4")), "num_experts must be an int, got str"),
        (lambda p: _npz(p, meta=_meta(model=5)), "model must be a str"),
        (lambda p: _claiming(p, (10**12, 1, 1)), "claims shape \\(1000000000000, 1, 1\\) .* but holds 4 bytes"),
    ],
)
def test_malformed_npz_files(tmp_path, build, message):
    path = build(tmp_path / "t.npz")
    with pytest.raises(TraceFileError, match=re.escape(str(path)) + ": .*" + message):
        load_bounded(path)


def test_a_folder_of_windows_that_disagree_on_layers(tmp_path):
    _write(tmp_path / "w0.jsonl", [_record(layer=0)])
    _write(tmp_path / "w1.jsonl", [_record(layer=1)])
    with pytest.raises(TraceFileError, match=re.escape(str(tmp_path)) + ": traces disagree on layers"):
        load_trace(tmp_path)


@pytest.mark.parametrize(
    "fields, error, message",
    [
        ({"expert_ids": np.array([[[0.5, 1.0]]])}, TypeError, "expert_ids must hold integers"),
        ({"expert_ids": np.array([[[True, False]]])}, TypeError, "expert_ids must hold integers"),
        ({"expert_ids": np.array([[[-2, 1]]])}, ValueError, "must be in \\[-1, 4\\)"),
        ({"num_experts": True}, TypeError, "num_experts must be an int"),
        ({"num_experts": 2**31}, ValueError, "num_experts must be in"),
        ({"forward_starts": [0.0]}, TypeError, "forward_starts must hold integers"),
        ({"forward_starts": [0, 5]}, ValueError, "below N"),
        ({"request_starts": [1, 0]}, ValueError, "request_starts must be strictly increasing"),
        ({"layers": [-1]}, ValueError, "layers must be non-negative"),
        ({"layers": [2**64 - 1]}, ValueError, "beyond int64"),
        ({"model": None}, TypeError, "model must be a str"),
    ],
)
def test_routing_trace_refuses_bad_fields(fields, error, message):
    base = {"expert_ids": np.array([[[0, 1]], [[2, 3]]]), "forward_starts": [0], "num_experts": 4}
    if "layers" in fields:
        base["expert_ids"] = base["expert_ids"][:, :1]
    with pytest.raises(error, match=message):
        RoutingTrace(**{**base, **fields})


def test_the_recorder_checks_ids_as_they_come():
    recorder = RoutingRecorder(layers=[0], num_experts=8)
    with pytest.raises(TypeError, match="integer expert ids, got dtype float32"):
        recorder.record(0, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="must be in \\[-1, 8\\)"):
        recorder.record(0, torch.tensor([[1, 8]]))
    wide = RoutingRecorder(layers=[0], num_experts=70000)
    wide.record(0, torch.tensor([[65537, 2]]))
    assert wide.trace().expert_ids.tolist() == [[[65537, 2]]]
    with pytest.raises(ValueError, match="layers must be distinct"):
        RoutingRecorder(layers=[0, 0])
