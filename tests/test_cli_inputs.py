"""Inputs and outputs of the commands: refused at once, in one line, with nothing written.

An output that names an input (or the other output), an output that cannot be written, an
empty path, a manifest of another model, a route log whose ``layers_logged`` disagrees with
its records, a token count past the model's positions: each exits with status 2 and one
line on stderr naming the problem, before any work, and leaves every file as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cli_errors import refused_in_one_line as _refused
from test_plan import _trace

from expertcache.cli import main
from expertcache.manifest import Manifest
from expertcache.trace import RoutingTrace, load_trace
from expertcache.trace.errors import TraceFileError

_PLAN = ["plan", "--expert-bytes", "1000", "--gpu-budget", "6e-6", "--no-progress"]


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (links as their names), to compare before and after."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture
def inputs(tmp_path) -> Path:
    """A trace file, a folder of two traces, a manifest, a plain file and a link to the trace."""
    _trace().save(tmp_path / "trace.npz")
    _trace().save(tmp_path / "trace.png")  # an .npz by content: what --plot could name
    (tmp_path / "folder").mkdir()
    for name in ("a.npz", "b.npz"):
        _trace(tokens=20).save(tmp_path / "folder" / name)
    _manifest(tmp_path / "manifest.json")
    (tmp_path / "plain").write_text("not a folder")
    (tmp_path / "link.csv").symlink_to(tmp_path / "trace.npz")
    return tmp_path


_NAMES = ("trace.npz", "trace.png", "folder", "manifest.json", "plain", "link.csv")  # what `inputs` holds


def _manifest(path: Path, **fields) -> Path:
    """A manifest of 8 experts per layer, 1000 bytes each, with ``fields`` in place of its own."""
    data = {"manifest_version": 2, "tensors": [], "layers": 2, "experts": 16, "expert_bytes": 1000,
            "num_slots": 6, "pool_gpu_bytes": 6000, "host_bytes": 16000, "pinned_host_bytes": 0,
            "full_residency_gpu_bytes": 16000, "gpu_bytes_freed": 10000, "device": "cpu", "compression": None,
            "compressed_expert_bytes": 1000}  # fmt: skip
    if "experts" in fields:  # the fully resident bytes follow the experts, as `build_manifest` writes them
        full = fields["experts"] * data["expert_bytes"]
        data.update(full_residency_gpu_bytes=full, gpu_bytes_freed=full - data["pool_gpu_bytes"])
    path.write_text(json.dumps({**data, **fields}))
    return path


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--trace", "{d}/trace.npz", "--csv", "{d}/trace.npz"], "--csv .*trace.npz is the same file as --trace"),
        (["--trace", "{d}/trace.png", "--plot", "{d}/trace.png"], "--plot .*trace.png is the same file as --trace"),
        (["--trace", "{d}/trace.npz", "--csv", "{d}/link.csv"], "--csv .*link.csv is the same file as --trace"),
        (["--trace", "{d}/folder", "--csv", "{d}/folder/b.npz"], "--csv .*b.npz is the same file as --trace .*b.npz"),
        (["--trace", "{d}/trace.npz", "--csv", "{d}/p.png", "--plot", "{d}/p.png"], "--plot .*p.png is the .* --csv"),
        (["--trace", "{d}/trace.npz", "--csv", "{d}/manifest.json"], None),  # with --manifest below
    ],
    ids=["csv=trace", "plot=trace", "csv links to trace", "csv in trace folder", "csv=plot", "csv=manifest"],
)  # fmt: skip
def test_an_output_naming_an_input_is_refused_and_nothing_changes(flags, expected, inputs, capsys):
    argv = ["plan", *(flag.format(d=inputs) for flag in flags), "--gpu-budget", "6e-6", "--no-progress"]
    if expected is None:
        argv += ["--manifest", str(inputs / "manifest.json")]
        expected = "--csv .*manifest.json is the same file as --manifest"
    else:
        argv += ["--expert-bytes", "1000"]
    before = _files(inputs)
    _refused(argv, capsys, expected)
    assert _files(inputs) == before


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--csv", "/dev/full"], "argument --csv: /dev/full: not a regular file"),
        (["--csv", "{d}/plain/x.csv"], "argument --csv: .*plain/x.csv: .*plain is not a folder"),
        (["--csv", "{d}/out.csv", "--plot", "{d}/plain/p.png"], "argument --plot: .*plain is not a folder"),
        (["--csv", "{d}/folder"], "argument --csv: .*folder: is a directory"),
        (["--csv", ""], "argument --csv: must name a file, got an empty string"),
        # Path("plain/") is Path("plain"): the file would be replaced, a missing one created
        (["--csv", "{d}/plain/"], "argument --csv: .*plain/: names a folder; give a file name"),
        (["--csv", "{d}/new/"], "argument --csv: .*new/: names a folder"),
        (["--plot", "{d}/new.png/."], "argument --plot: .*new.png/.: names a folder"),
        (["--csv", "{d}/" + "a" * 300 + ".csv"], "argument --csv: .*a.csv: File name too long"),  # stat raises
    ],
)
def test_an_unwritable_output_is_refused_before_the_trace_is_read(flags, expected, inputs, capsys):
    before = _files(inputs)
    _refused([*_PLAN, "--trace", str(inputs / "trace.npz"), *(f.format(d=inputs) for f in flags)], capsys, expected)
    assert _files(inputs) == before  # out.csv, beside the bad --plot, was not written either
    assert sorted(path.name for path in inputs.iterdir()) == sorted(_NAMES)


def test_a_saved_trace_named_as_a_folder_is_refused(tmp_path, capsys):
    (tmp_path / "kept").write_text("keep")
    for name in ("kept/", "new/", "new/."):
        _refused(["demo", "--save-trace", f"{tmp_path}/{name}"], capsys, f"--save-trace: .*{name}: names a folder")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["kept"] and (tmp_path / "kept").read_text() == "keep"


def test_links_that_lead_nowhere_are_refused_in_one_line(inputs, capsys):
    """A loop of links (an output or the trace) and a link into a missing folder: refused before
    any work, never a traceback (Path.resolve raises RuntimeError on a loop)."""
    (inputs / "loop.csv").symlink_to(inputs / "loop.csv")
    (inputs / "dangling.csv").symlink_to(inputs / "gone" / "x.csv")
    trace = ["--trace", str(inputs / "trace.npz")]
    _refused([*_PLAN, *trace, "--csv", str(inputs / "loop.csv")], capsys, "--csv: .*loop.csv: a loop of symbolic links")
    _refused([*_PLAN, *trace, "--csv", str(inputs / "dangling.csv")], capsys, "dangling.csv: the folder .*gone does")
    _refused([*_PLAN, "--trace", str(inputs / "loop.csv"), "--csv", str(inputs / "o.csv")], capsys, "loop.csv")
    assert not (inputs / "o.csv").exists() and not (inputs / "gone").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: access() refuses nothing")
def test_a_read_only_folder_or_file_is_refused(inputs, capsys):
    (inputs / "locked").mkdir()
    (inputs / "locked").chmod(0o500)
    (inputs / "kept.csv").write_text("keep")
    (inputs / "kept.csv").chmod(0o400)
    try:
        trace = ["--trace", str(inputs / "trace.npz")]
        _refused([*_PLAN, *trace, "--csv", str(inputs / "locked" / "x.csv")], capsys, "locked is not writable")
        _refused([*_PLAN, *trace, "--csv", str(inputs / "kept.csv")], capsys, "kept.csv: the file is not writable")
    finally:
        (inputs / "locked").chmod(0o700)
    assert (inputs / "kept.csv").read_text() == "keep" and not any((inputs / "locked").iterdir())


@pytest.mark.skipif(sys.platform != "linux", reason="a file-size limit (RLIMIT_FSIZE) as on Linux")
def test_a_plot_the_disk_refuses_leaves_the_old_csv(inputs, tmp_path_factory):
    """The CSV fits under a file-size limit, the PNG does not (as on a disk that fills up
    between them): exit 2, one line naming the PNG, and both files as they were."""
    (inputs / "old.csv").write_text("old csv")
    argv = [*_PLAN, "--trace", str(inputs / "trace.npz"), "--csv", str(inputs / "old.csv"),
            "--plot", str(inputs / "new.png")]  # fmt: skip
    limited = (
        "import resource, signal, sys\n"
        "import matplotlib.font_manager\n"  # its font cache is written first, under no limit
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))\n"
        "from expertcache.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    environment = {
        **os.environ,
        "MPLCONFIGDIR": str(tmp_path_factory.mktemp("mpl")),
    }  # matplotlib's cache: not our write
    done = subprocess.run([sys.executable, "-c", limited, *argv], capture_output=True, text=True, env=environment)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"expertcache plan: error: {inputs / 'new.png'}: File too large"
    assert (inputs / "old.csv").read_text() == "old csv" and not (inputs / "new.png").exists()
    assert sorted(path.name for path in inputs.iterdir()) == sorted([*_NAMES, "old.csv"])  # no scratch left


def test_a_plot_that_fails_leaves_no_csv(inputs, capsys, monkeypatch):
    """Both files are rendered before either is written."""
    import expertcache.plan_plot

    def fail(*args, **kwargs):
        raise ValueError("cannot draw")

    monkeypatch.setattr(expertcache.plan_plot, "render_plan", fail)
    argv = [
        *_PLAN,
        "--trace",
        str(inputs / "trace.npz"),
        "--csv",
        str(inputs / "o.csv"),
        "--plot",
        str(inputs / "o.png"),
    ]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == "expertcache plan: error: cannot draw"
    assert not (inputs / "o.csv").exists() and not (inputs / "o.png").exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([*_PLAN, "--trace", ""], "argument --trace: must name a file or folder, got an empty string"),
        (["plan", "--trace", "t.npz", "--manifest", " ", "--gpu-budget", "1"], "argument --manifest: must name a file"),
        (["generate", "--model", "", "--moe-expert-cache-size", "4"], "argument --model: must name a file or folder"),
    ],
)
def test_an_empty_path_is_refused(argv, expected, capsys, tmp_path, monkeypatch):
    _trace().save(tmp_path / "trace.npz")  # the current folder holds a trace: "" must not load it
    monkeypatch.chdir(tmp_path)
    _refused(argv, capsys, expected)
    with pytest.raises(ValueError, match="the trace path is empty"):
        load_trace("")


def test_a_manifest_of_another_model_is_refused(inputs, capsys):
    """The manifest says 8 experts per layer; the trace 16 (with --num-experts)."""
    argv = ["plan", "--trace", str(inputs / "trace.npz"), "--manifest", str(inputs / "manifest.json"),
            "--num-experts", "16", "--gpu-budget", "6e-6", "--no-progress", "--csv", str(inputs / "o.csv")]  # fmt: skip
    _refused(argv, capsys, "manifest.json has 8 experts per layer, the trace 16: the plan would be for another model")
    assert not (inputs / "o.csv").exists()


_CODED = {"compression": "exponent"}
_POSITIVE = "must be a positive integer, got"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({**_CODED, "compressed_expert_bytes": "500"}, f"'compressed_expert_bytes' {_POSITIVE} '500'"),
        ({"compressed_expert_bytes": -1}, f"'compressed_expert_bytes' {_POSITIVE} -1"),
        ({"compressed_expert_bytes": 0}, f"'compressed_expert_bytes' {_POSITIVE} 0"),
        ({**_CODED, "compressed_expert_bytes": 500.5}, f"'compressed_expert_bytes' {_POSITIVE} 500.5"),
        ({**_CODED, "compressed_expert_bytes": 500.0}, f"'compressed_expert_bytes' {_POSITIVE} 500.0"),  # not 500
        ({"compressed_expert_bytes": True}, f"'compressed_expert_bytes' {_POSITIVE} True"),
        ({**_CODED, "compressed_expert_bytes": 2000},
         "'compressed_expert_bytes' must be at most the 'expert_bytes' \\(1,000\\), got 2,000"),
        ({"compressed_expert_bytes": 500},
         "'compressed_expert_bytes' \\(500\\) must equal 'expert_bytes' \\(1000\\) when 'compression' is null"),
        ({"compression": "zstd"}, "'compression' must be null or one of exponent, got 'zstd'"),
        ({"compression": 5}, "'compression' must be null or one of exponent, got 5"),
        ({"expert_bytes": 10**30}, "'expert_bytes' must be at most MAX_EXPERT_BYTES \\(1,099,511,627,776\\)"),
        ({"expert_bytes": 1e30}, f"'expert_bytes' {_POSITIVE} 1e\\+30"),
        ({"expert_bytes": 1000.0}, f"'expert_bytes' {_POSITIVE} 1000.0"),
    ],
)  # fmt: skip
def test_a_manifest_field_out_of_range_is_refused_naming_file_and_field(fields, expected, tmp_path, capsys):
    path = _manifest(tmp_path / "bad.json", **fields)
    _trace().save(tmp_path / "trace.npz")
    argv = ["plan", "--trace", str(tmp_path / "trace.npz"), "--manifest", str(path), "--gpu-budget", "6e-6"]
    _refused([*argv, "--compression", "exponent", "--no-progress"], capsys, f"--manifest .*bad.json: {expected}")
    with pytest.raises(ValueError, match=f"bad.json: {expected}"):
        Manifest.read(path)


def test_a_measured_manifest_within_range_is_taken(tmp_path, capsys):
    path = _manifest(tmp_path / "m.json", compression="exponent", compressed_expert_bytes=1000)  # coded, no gain
    _trace().save(tmp_path / "trace.npz")
    argv = ["plan", "--trace", str(tmp_path / "trace.npz"), "--manifest", str(path), "--gpu-budget", "6e-6"]
    assert main([*argv, "--compression", "exponent", "--no-progress"]) == 0
    assert "bytes per miss 1,000 (1.000 of the expert bytes, exponent-coded, measured" in capsys.readouterr().out


def _route_log(path: Path, layers_logged: object, layers: list[int]) -> Path:
    meta = {"type": "meta", "model_id": "m", "top_k": 2, "num_experts": 8, "layers_logged": layers_logged}
    # one call a layer: token_idx restarts at each
    rows = [{"type": "route", "token_idx": token, "layer": layer, "topk_ids": [token % 8, (token + 1) % 8]}
            for layer in layers for token in range(6)]  # fmt: skip
    path.write_text("\n".join(json.dumps(line) for line in [meta, *rows]) + "\n")
    return path


@pytest.mark.parametrize(
    ("declared", "layers", "expected"),
    [
        ([0, 1], [0], "'layers_logged' is \\[0, 1\\] but the route records are of layers \\[0\\]"),
        ([0], [0, 3], "'layers_logged' is \\[0\\] but the route records are of layers \\[0, 3\\]"),
        ("0", [0], "'layers_logged' must be a list of layer numbers, got string '0'"),
        ([0.0], [0], "'layers_logged' must be a list of layer numbers"),
    ],
)
def test_a_route_log_whose_records_are_not_of_its_layers_logged_is_refused(
    declared, layers, expected, tmp_path, capsys
):
    path = _route_log(tmp_path / "log.jsonl", declared, layers)
    with pytest.raises(TraceFileError, match=f"log.jsonl:1: meta record: {expected}"):
        load_trace(path)
    _refused([*_PLAN, "--trace", str(path)], capsys, f"log.jsonl:1: meta record: {expected}")


def test_a_route_log_whose_layers_logged_match_loads(tmp_path):
    trace = load_trace(_route_log(tmp_path / "log.jsonl", [3, 0], [0, 3]))
    assert trace.layers.tolist() == [0, 3] and trace.num_tokens == 6
    assert load_trace(_route_log(tmp_path / "old.jsonl", None, [0])).num_tokens == 6  # a log that does not say


def test_demo_refuses_more_tokens_than_the_model_has_positions(capsys):
    """The demo's model has 512 positions (random_models); its prompt is 24 tokens."""
    _refused(["demo", "--new-tokens", "489", "--device", "cpu"], capsys,
             "--new-tokens 489: 24 prompt tokens \\+ 489 new tokens = 513, more than the model's "
             "max_position_embeddings \\(512\\)")  # fmt: skip


def test_generate_refuses_to_write_its_trace_over_a_checkpoint_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_moe"}')
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    before = _files(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--moe-expert-cache-size", "4", "--save-trace"]
    _refused([*argv, str(tmp_path / "model.safetensors")], capsys, "--save-trace .*model.safetensors is the same file")
    assert _files(tmp_path) == before


def test_a_plan_never_recommends_fewer_slots_than_the_runtime_takes():
    """Top-2 of 8 experts, 2 layers: a budget of 3 slots is 1 a layer, below the runtime's 2."""
    from expertcache.config import cache_size_range
    from expertcache.planner import plan

    top2 = np.random.default_rng(0).random((20, 2, 8)).argsort(axis=2)[..., :2]  # distinct ids a record
    trace = RoutingTrace(top2, list(range(20)), num_experts=8)
    low = plan(trace, expert_bytes=1000, gpu_budget_bytes=3000)
    assert low.min_cache_size == cache_size_range(2, 8).start == 2
    assert low.layer_cache_size == 1 and all(row.slots >= 2 for row in low.rows if row.scope == "layer")
    enough = plan(trace, expert_bytes=1000, gpu_budget_bytes=4000)
    assert enough.layer_cache_size == 2 and enough.row("layer", 2, enough.layer_policy)


def test_python_dash_m_runs_the_command_and_refuses_in_one_line():
    """``python -m expertcache`` is the ``expertcache`` command: same parser, same exit status."""
    done = subprocess.run(
        [sys.executable, "-m", "expertcache", "plan", "--trace", "", "--expert-bytes", "1", "--gpu-budget", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "expertcache plan: error: argument --trace: must name a file or folder, got an empty string"
    ]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            [
                "plan",
                "--policies",
                "lru",
                "--policies",
                "arc",
                "--trace",
                "t.npz",
                "--expert-bytes",
                "8",
                "--gpu-budget",
                "1",
            ],
            "--policies given twice: give each flag once",
        ),
        (
            ["plan", "--gpu-budget", "1", "--gpu-budget=2", "--trace", "t.npz", "--expert-bytes", "8"],
            "--gpu-budget given twice",
        ),
        (["demo", "--new-tokens", "4", "--new-tokens", "8"], "--new-tokens given twice"),
    ],
)
def test_a_flag_given_twice_is_refused_not_the_first_value_ignored(argv, expected, capsys):
    """The stock parser kept the last value of a repeated flag and ignored the first."""
    _refused(argv, capsys, expected)
