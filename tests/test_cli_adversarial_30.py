"""What a user can get wrong around the ``expertcache`` commands, found by trying (round 30):

- an abbreviated flag (``--gpu`` for ``--gpu-budget``), which argparse took by default;
- a model config whose ``num_experts_per_tok`` routes each token to no expert, to more
  experts than there are, or is no whole number;
- Ctrl-C between the renames of a multi-file write;
- a checkpoint ``generate`` refuses: transformers' own load report printed before our line.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import checkpoint_with
from test_cli_errors import _check_one_line, refused_in_one_line

from expertcache import file_writes
from expertcache.cli import build_parser, main
from expertcache.file_writes import write_files
from expertcache.trace import RoutingTrace

ROOT = Path(__file__).resolve().parents[1]

# -- abbreviated flags -------------------------------------------------------------------------

#: Each command's required flags, all given (and spelled out), so that the only fault is the abbreviation.
_WHOLE_COMMAND = {
    "demo": ["demo"],
    "generate": ["generate", "--model", "/nonexistent/model", "--moe-expert-cache-size", "4"],
    "plan": ["plan", "--trace", "/nonexistent/trace.npz", "--expert-bytes", "5", "--gpu-budget", "1"],
}


def _subcommands() -> dict:
    parser = build_parser()
    return next(action for action in parser._actions if action.dest == "command").choices


def _abbreviations() -> list[tuple[str, str, str, bool]]:
    """``(command, flag, an unambiguous prefix of it, whether it takes a value)``: the shortest
    (two letters or more) and the longest such prefix of every long flag of every command that
    has one (``--compression`` has none: it begins ``--compression-ratio``)."""
    cases = []
    for command, parser in _subcommands().items():
        flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
        for action in parser._actions:
            for flag in (flag for flag in action.option_strings if flag.startswith("--")):
                prefixes = [flag[:end] for end in range(4, len(flag))]
                unique = [prefix for prefix in prefixes if sum(other.startswith(prefix) for other in flags) == 1]
                cases += [
                    (command, flag, prefix, action.nargs != 0) for prefix in dict.fromkeys(unique[:1] + unique[-1:])
                ]
    return cases


ABBREVIATIONS = _abbreviations()
# every command is tried (a command added later without a line in _WHOLE_COMMAND fails here)
assert {case[0] for case in ABBREVIATIONS} == set(_subcommands()) == set(_WHOLE_COMMAND)


@pytest.mark.parametrize(
    ("command", "flag", "abbreviation", "takes_value"), ABBREVIATIONS, ids=[f"{c[0]} {c[2]}" for c in ABBREVIATIONS]
)
def test_every_flag_of_every_command_refuses_its_abbreviation(
    command, flag, abbreviation, takes_value, capsys, monkeypatch
):
    import expertcache.demo

    monkeypatch.setattr(expertcache.demo, "run_demo", lambda **kwargs: [])  # were the flag taken: no model built
    given = [abbreviation, "1"] if takes_value else [abbreviation]
    argv = _WHOLE_COMMAND[command] + given
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"expertcache: error: unrecognized arguments: {' '.join(given)}\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["--hel", "demo"],  # the top-level parser's --help
        ["plan", "--trace", "t.npz", "--expert-bytes", "5", "--gpu-budget", "1", "--bandw=2"],  # --flag=value too
    ],
)
def test_the_top_level_parser_and_the_equals_form_refuse_abbreviations(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    unknown = argv[0] if argv[0] == "--hel" else argv[-1]
    assert capsys.readouterr().err == f"expertcache: error: unrecognized arguments: {unknown}\n"


def test_an_abbreviated_required_flag_is_one_line_from_the_installed_command(tmp_path):
    """``--gpu`` for ``--gpu-budget``: the plan ran, on a budget the user never spelled out."""
    ids = np.random.default_rng(0).random((20, 2, 8)).argsort(axis=2)[..., :2]
    trace = RoutingTrace(ids, list(range(20)), num_experts=8).save(tmp_path / "trace.npz")
    argv = ["plan", "--trace", str(trace), "--expert-bytes", "5", "--gpu", "1", "--no-progress"]
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "expertcache", *argv], capture_output=True, text=True, env=environment, timeout=300
    )
    assert run.returncode == 2 and run.stdout == ""
    _check_one_line(run.stderr, argv, "the following arguments are required: --gpu-budget")


# -- a config's top-k --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "top_k",
    [
        0,  # ran: "hit rate 100.0% (0 hits, 0 misses)", every token routed to no expert
        -1,  # ran until torch.topk's traceback
        9,  # more than the 8 experts: refused as a cache size "between 9 and 8"
    ],
)
def test_generate_refuses_a_config_top_k_that_is_no_top_k(checkpoint, tmp_path, top_k, capsys):
    model = checkpoint_with(checkpoint, tmp_path, num_experts_per_tok=top_k)
    argv = ["generate", "--model", str(model), "--moe-expert-cache-size", "4", "--device", "cpu",
            "--max-new-tokens", "2"]  # fmt: skip
    expected = f"num_experts_per_tok \\(the router's top-k\\) must be a whole number from 1 to 8 .*, got {top_k}$"
    refused_in_one_line(argv, capsys, expected)


@pytest.mark.parametrize(
    "top_k",
    [
        0,  # routes each token to no expert
        -3,
        9,  # more than the tiny model's 8 experts
        True,  # a bool is not a count (it was top-1)
        2.0,  # a float, even a whole one
        "2",
    ],
)
def test_enabling_the_cache_refuses_a_config_top_k_that_is_no_top_k(top_k):
    from transformers_helpers import tiny_model

    from expertcache.integrations.transformers import enable_expert_cache

    model = tiny_model("qwen2_moe")
    # past transformers' own check of the field (a remote-code config class has none)
    object.__setattr__(model.config, "num_experts_per_tok", top_k)
    experts = model.model.layers[0].mlp.experts
    shape = experts.gate_up_proj.shape
    with pytest.raises(ValueError, match=f"num_experts_per_tok .* got {top_k!r}$"):
        enable_expert_cache(model, cache_size=4, device="cpu")
    assert experts.gate_up_proj.shape == shape  # nothing changed: the experts are where they were


# -- Ctrl-C between renames ----------------------------------------------------------------------


def _folder(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of ``path``: its bytes and mode."""
    return {item.name: (item.read_bytes(), item.stat().st_mode) for item in sorted(path.iterdir())}


def _interrupt_rename(monkeypatch, number: int, *, after: bool) -> None:
    """Make the ``number``-th rename of a scratch file over its target raise KeyboardInterrupt:
    instead of renaming, or just after it (Ctrl-C landing between two renames)."""
    real, count = os.replace, [0]

    def replace(source, target):
        if os.fspath(source).endswith(".partial"):
            count[0] += 1
            if count[0] == number:
                if after:
                    real(source, target)
                raise KeyboardInterrupt
        real(source, target)

    monkeypatch.setattr(file_writes.os, "replace", replace)


@pytest.mark.parametrize("after", [False, True], ids=["at-the-rename", "just-after-it"])
@pytest.mark.parametrize("first_exists", [True, False], ids=["first-replaced", "first-new"])
def test_an_interrupt_at_the_second_rename_leaves_the_folder_as_it_was(tmp_path, monkeypatch, after, first_exists):
    first, second, third = tmp_path / "a.csv", tmp_path / "b.png", tmp_path / "c.json"
    if first_exists:
        first.write_bytes(b"old a")
        os.chmod(first, 0o600)
    second.write_bytes(b"old b")
    before = _folder(tmp_path)
    _interrupt_rename(monkeypatch, 2, after=after)
    with pytest.raises(KeyboardInterrupt):
        write_files({first: b"new a", second: b"new b", third: b"new c"})
    assert _folder(tmp_path) == before  # no new file, no scratch, no kept copy


def test_an_interrupt_while_an_old_file_is_kept_aside_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    """Ctrl-C just after the second old file got its second name (a hard link)."""
    files = {tmp_path / name: f"new {name}".encode() for name in ("a.csv", "b.png", "c.json")}
    for path in files:
        path.write_bytes(b"old")
    before = _folder(tmp_path)
    real, count = os.link, [0]

    def link(source, target):
        real(source, target)
        count[0] += 1
        if count[0] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(file_writes.os, "link", link)
    with pytest.raises(KeyboardInterrupt):
        write_files(files)
    assert _folder(tmp_path) == before


def test_an_interrupt_after_the_last_rename_finds_every_file_new_and_no_kept_one(tmp_path, monkeypatch):
    files = {tmp_path / name: f"new {name}".encode() for name in ("a.csv", "b.png", "c.json")}
    for path in files:
        path.write_bytes(b"old")
    _interrupt_rename(monkeypatch, 3, after=True)
    with pytest.raises(KeyboardInterrupt):
        write_files(files)
    assert {name: data for name, (data, _) in _folder(tmp_path).items()} == {
        path.name: data for path, data in files.items()
    }  # the write was whole: every file new, no old one kept aside


def test_an_old_file_an_interrupt_cannot_put_back_is_named_on_the_interrupt(tmp_path, monkeypatch):
    first, second = tmp_path / "a.csv", tmp_path / "b.png"
    first.write_bytes(b"old a")
    second.write_bytes(b"old b")
    real = os.replace

    def replace(source, target):
        if os.fspath(source).endswith(".old"):
            raise PermissionError(13, "Permission denied")
        if os.fspath(target) == str(second):
            raise KeyboardInterrupt
        real(source, target)

    monkeypatch.setattr(file_writes.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt) as interrupt:
        write_files({first: b"new a", second: b"new b"})
    kept = [path for path in tmp_path.iterdir() if path.name.endswith(".old")]
    assert len(kept) == 1 and kept[0].read_bytes() == b"old a"
    assert getattr(interrupt.value, "__notes__", None) == [f"{first} could not be put back, its old file is {kept[0]}"]


# -- transformers' output of a refused load ------------------------------------------------------


def _transformers_output_state():
    from transformers.utils import logging as transformers_logging

    library = logging.getLogger("transformers")
    return library.handlers[:], library.propagate, library.level, transformers_logging.is_progress_bar_enabled()


def _generate(model: Path) -> list[str]:
    return ["generate", "--model", str(model), "--moe-expert-cache-size", "4", "--device", "cpu",
            "--max-new-tokens", "2"]  # fmt: skip


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` run as the installed command (transformers' handler writes to the process's stderr)."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "expertcache", *argv], capture_output=True, text=True, env=environment, timeout=300
    )


def test_a_checkpoint_without_the_expert_weights_is_refused_in_one_line(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    kept = {name: tensor for name, tensor in weights.items() if ".experts." not in name}
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    argv = _generate(tmp_path)
    run = _run(argv)  # was: the "Loading weights" bar and transformers' LOAD REPORT table, then our line
    assert run.returncode == 2 and run.stdout == ""
    _check_one_line(run.stderr, argv, "the checkpoint has no weights for 4 of the model's parameters")


def test_a_load_transformers_refuses_is_one_line_with_its_report(checkpoint, tmp_path):
    """A weight of another shape: transformers raises, pointing at its report, which the line carries."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = torch.zeros(weights[name].shape[0] + 1, weights[name].shape[1])
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    argv = _generate(tmp_path)
    run = _run(argv)
    assert run.returncode == 2 and run.stdout == ""
    _check_one_line(
        run.stderr, argv, f"cannot load the weights \\(RuntimeError: .*; transformers' load report: {name} MISMATCH "
    )
    assert "torch.Size([33, 32]) vs model:torch.Size([32, 32])" in run.stderr


def test_an_accepted_load_shows_what_transformers_said_of_it(checkpoint, tmp_path):
    """A weight the model has no place for: the load goes on, and transformers' report of it is
    shown (after the load, in its own format); the progress bar is not drawn."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    save_file({**weights, "model.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    run = _run(_generate(tmp_path))
    assert run.returncode == 0, run.stderr
    assert "output token ids" in run.stdout
    lines = run.stderr.splitlines()
    assert lines[0].startswith("[transformers] ") and "LOAD REPORT" in lines[0]
    assert any(line.startswith("model.extra.weight") and "UNEXPECTED" in line for line in lines)
    assert "Loading weights" not in run.stderr  # the bar would come before a refusal too


def test_a_refused_load_in_process_prints_one_line_and_restores_transformers_output(checkpoint, monkeypatch, capsys):
    """What transformers logs and warns during the load is held (here: a log record and a Python
    warning), dropped when the load is refused, and its logging set-up is as it was after."""
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained.__func__

    def loads_without_experts(cls, *args, **kwargs):
        logging.getLogger("transformers.modeling_utils").warning("a report of the load")
        warnings.warn("a warning of the load", UserWarning, stacklevel=1)
        model, loading = real(cls, *args, **kwargs)
        return model, {**loading, "missing_keys": {"model.layers.0.mlp.experts.gate_up_proj"}}

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(loads_without_experts))
    before = _transformers_output_state()
    argv = _generate(checkpoint)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    _check_one_line(captured.err, argv, "the checkpoint has no weights for 1 of the model's parameters")
    assert _transformers_output_state() == before
