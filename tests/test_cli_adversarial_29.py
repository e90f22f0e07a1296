"""What a user can get wrong around the ``expertcache`` commands, found by trying: each case is
one line and exit status 2 (or, for a closed output pipe, a quiet end), never a traceback, and
a flag that does nothing says so.

- a ``config.json`` whose values transformers refuses, or whose sizes build no model;
- a checkpoint without weights for some parameters (transformers would start them at random);
- the ``transformers`` extra not installed;
- ``expertcache plan ... | head``: the reader of the output goes away;
- ``demo --no-graphs`` where the demo makes no graphed runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import checkpoint_with
from test_cli_errors import _check_one_line

from expertcache.cli import STATUS_PIPE_CLOSED, main
from expertcache.trace import RoutingTrace
from expertcache.trace.format import UNALIGNED_LAYERS

ROOT = Path(__file__).resolve().parents[1]


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_info:  # the parser's refusals
        return exit_info.code  # type: ignore[return-value]


def _python(code: str, *, stdout=subprocess.PIPE, env: dict[str, str] | None = None) -> subprocess.Popen:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    environment.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=stdout, stderr=subprocess.PIPE, text=True, env=environment
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # transformers' strict config fields raise their own exception type (not a ValueError)
        ({"hidden_size": "abc"}, "config.json has a value transformers refuses .*'hidden_size'"),
        ({"vocab_size": None}, "config.json has a value transformers refuses .*'vocab_size'"),
        ({"dtype": "float99"}, "config.json has a value transformers refuses .*float99"),  # AttributeError
        ({"num_attention_heads": 0}, "describes no model transformers can build \\(ZeroDivisionError"),
        ({"hidden_size": 10**12}, "describes no model transformers can build \\(RuntimeError"),  # size overflows
    ],
)
def test_a_config_transformers_refuses_is_one_line_before_the_weights(checkpoint, tmp_path, fields, expected, capsys):
    model = checkpoint_with(checkpoint, tmp_path, **fields)
    argv = ["generate", "--model", str(model), "--moe-expert-cache-size", "4", "--device", "cpu"]
    status = _status(argv)
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    _check_one_line(captured.err, argv, expected)


def test_a_checkpoint_without_the_expert_weights_is_refused(checkpoint, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    kept = {name: tensor for name, tensor in weights.items() if ".experts." not in name}
    assert len(kept) < len(weights)  # the tiny model's experts are in the file
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    argv = ["generate", "--model", str(tmp_path), "--moe-expert-cache-size", "4", "--device", "cpu"]
    status = _status(argv)
    captured = capsys.readouterr()
    assert status == 2
    assert "output token ids" not in captured.out  # nothing generated from random experts
    last = captured.err.strip().splitlines()[-1]  # transformers' own load report comes first
    assert last.startswith("expertcache generate: error: --model ")
    assert "the checkpoint has no weights for 4 of the model's parameters (model.layers.0.mlp.experts." in last
    assert "transformers would start them at random" in last


@pytest.mark.parametrize("command", ["demo --new-tokens 2", "generate --model {model} --moe-expert-cache-size 4"])
def test_without_the_transformers_extra_a_command_says_what_to_install(checkpoint, command):
    argv = [part.format(model=checkpoint) for part in command.split()]
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None  # as if the extra were not installed\n"
        "from expertcache.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    process = _python(code)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 2, err
    _check_one_line(err, argv, "needs the 'transformers' package, which is not installed: "
                    "pip install 'expertcache\\[transformers\\]'")  # fmt: skip


def test_a_closed_output_pipe_ends_plan_quietly_after_writing_its_csv(tmp_path):
    ids = np.random.default_rng(0).random((20, 2, 8)).argsort(axis=2)[..., :2]
    trace = RoutingTrace(ids, list(range(20)), num_experts=8).save(tmp_path / "trace.npz")
    argv = ["plan", "--trace", str(trace), "--expert-bytes", "5", "--gpu-budget", "1", "--no-progress",
            "--csv", str(tmp_path / "plan.csv")]  # fmt: skip
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command prints (`| head` that has read enough)
    code = f"import sys\nfrom expertcache.cli import main\nsys.exit(main({argv!r}))\n"
    # unbuffered: the first print fails, as it does once more than a buffer of output is printed
    process = _python(code, stdout=write_end, env={"PYTHONUNBUFFERED": "1"})
    os.close(write_end)
    _, err = process.communicate(timeout=120)
    assert process.returncode == STATUS_PIPE_CLOSED, err
    assert err == ""  # not "error: Broken pipe", not "Exception ignored"
    assert (tmp_path / "plan.csv").read_text().startswith("scope,")  # the file the user asked for


def test_no_graphs_where_the_demo_makes_no_graphed_runs_says_it_does_nothing(monkeypatch, capsys):
    import expertcache.demo

    calls = []
    monkeypatch.setattr(expertcache.demo, "run_demo", lambda **kwargs: calls.append(kwargs) or [])
    assert main(["demo", "--device", "cpu", "--new-tokens", "2", "--no-graphs"]) == 0
    assert calls[0]["graphs"] is False
    assert capsys.readouterr().err == (
        "expertcache demo: warning: --no-graphs has no effect here: the demo runs on the CPU, "
        "where it makes no graphed runs to skip\n"
    )
    assert main(["demo", "--device", "cpu", "--new-tokens", "2"]) == 0  # no flag: nothing to say
    assert capsys.readouterr().err == ""


def test_a_checkpoint_whose_quantization_needs_a_missing_package_is_one_line(checkpoint, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    def needs_accelerate(*args, **kwargs):  # what an mxfp4 checkpoint raises without accelerate
        raise ImportError("Using mxfp4 requires Accelerate: `pip install accelerate`")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", needs_accelerate)
    argv = ["generate", "--model", str(checkpoint), "--moe-expert-cache-size", "4", "--device", "cpu"]
    status = main(argv)  # was: the ImportError's traceback, exit status 1
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    _check_one_line(captured.err, argv, "cannot load the weights \\(ImportError: Using mxfp4 requires Accelerate")


def test_a_warning_a_command_raises_is_one_line_naming_the_command(tmp_path):
    """The planner's global rows on a Mixtral decode file (rows not aligned across layers)
    warn that they are approximate: on the command line that is one line, not Python's two."""
    trace = tmp_path / "unaligned.npz"
    RoutingTrace(
        expert_ids=np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]]], dtype=np.int32),
        forward_starts=np.array([0, 1]),
        num_experts=4,
        layers=(0, 1),
        notes=UNALIGNED_LAYERS,
    ).save(trace)
    run = subprocess.run(
        [sys.executable, "-m", "expertcache", "plan", "--trace", str(trace), "--gpu-budget", "1",
         "--expert-bytes", "1000000", "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    warning_lines = [line for line in run.stderr.splitlines() if "warning" in line.lower()]
    assert warning_lines and all(line.startswith("expertcache plan: warning: ") for line in warning_lines)
    assert "not aligned across layers" in warning_lines[0] and "planner.py" not in run.stderr
