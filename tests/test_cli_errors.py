"""Every ``expertcache`` command, given bad input, exits with status 2 and one line on stderr.

The table runs each invocation as its own process (``python -m expertcache.cli ...``, as a
user would), several at a time, and checks the exit status, that stderr is exactly one line
``expertcache[ <command>]: error: ...`` naming the problem, and that no traceback appears.
Every case fails before a model is built, so the table stays fast. A second table runs more
cases in this process through `expertcache.cli.main`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from expertcache.cli import main
from expertcache.trace import RoutingTrace

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("demo", "generate", "plan")
_NINES = "9" * 400
_GENERATE = "generate --model {no_weights} --moe-expert-cache-size 4"
_PLAN = "plan --trace {trace} --expert-bytes 5 --gpu-budget 1"

#: (command line with {placeholders} for the files of `bad_files`, what the one line must say).
SUBPROCESS_CASES = [
    ("", "expertcache: error: the following arguments are required: command"),
    ("demo --device cuda:99", "CUDA is not available" if not torch.cuda.is_available() else "does not exist"),
    ("demo --save-trace {missing}/t.npz", "the folder .*missing does not exist"),
    (_GENERATE.replace("{no_weights}", "{bad_config}"), "config.json is not JSON"),
    (_GENERATE, "no weights"),
    (f"{_GENERATE} --moe-expert-cache-mode device --moe-expert-cache-policy lfu", "only the lru policy"),
    (f"{_GENERATE} --moe-pin-budget {_NINES}", "is more than 9007199254740992 bytes"),
    ("plan --trace {missing}/t.npz --expert-bytes 5 --gpu-budget 1", "no such file"),
    (_PLAN.replace("{trace}", "{empty_trace}"), "has no routing records"),
    (_PLAN.replace("{trace}", "{bad_jsonl}"), ":2: not UTF-8 text"),
    (_PLAN.replace("1", "nan"), "--gpu-budget: must be a positive finite number"),
    (f"{_PLAN} --policies ''", "no policy to score"),
    ("plan --trace {trace} --manifest {bad_manifest} --gpu-budget 1", "not JSON"),
    (f"{_PLAN} --csv {{trace}}", "--csv .*trace.npz is the same file as --trace .*trace.npz"),
    ("plan --trace '' --expert-bytes 5 --gpu-budget 1", "argument --trace: must name a file or folder"),
]

if not torch.cuda.is_available():  # with a GPU, device mode runs (on it)
    SUBPROCESS_CASES.append((f"{_GENERATE} --moe-expert-cache-mode device", "mode 'device' runs its admission"))

#: More cases, run through `main` in this process.
IN_PROCESS_CASES = [
    ("fly", "invalid choice: 'fly'"),
    ("demo --device tpu", "not a device: 'tpu'"),
    ("demo --family gpt5", "invalid choice: 'gpt5'"),
    ("demo --new-tokens 0", "must be at least 1, got 0"),
    ("demo --new-tokens 1.5", "--new-tokens: must be a whole number, got '1.5'"),
    ("demo --save-trace {folder}", "is a directory"),
    ("generate --moe-expert-cache-size 4", "the following arguments are required: --model"),
    ("generate --model {missing} --moe-expert-cache-size 4", "no such directory"),
    ("generate --model {no_weights}", "needs --moe-expert-cache-size"),
    (_GENERATE.replace(" 4", " 99999999999"), "must be at most 2147483647"),
    (_GENERATE.replace("{no_weights}", "{not_a_config}"), "no 'model_type'"),
    (f"{_GENERATE} --moe-expert-cache-policy belady", "invalid choice: 'belady'"),
    (f"{_GENERATE} --moe-pin-budget 9007199254740993", "is more than 9007199254740992 bytes"),
    (f"{_GENERATE} --moe-pin-budget 1e5", "not a byte size: '1e5'"),
    (f"{_GENERATE} --prompt ' '", "--prompt is empty"),
    (f"{_GENERATE} --device cuda:7", "CUDA"),
    (f"{_GENERATE} --save-trace {{missing}}/t", "the folder .*missing does not exist"),
    (_PLAN.replace("{trace}", "{text_npz}"), "not an .npz archive"),
    (_PLAN.replace("{trace}", "{folder}"), "no routing trace inside"),
    (_PLAN.replace("1", "inf"), "positive finite number"),
    (_PLAN.replace("1", "-1"), "positive finite number"),
    (_PLAN.replace("1", "1e300"), "must be at most 1e\\+09"),
    (_PLAN.replace("1", "x"), "must be a number, got 'x'"),
    (_PLAN.replace("5", "0"), "must be at least 1, got 0"),
    (f"{_PLAN} --bandwidth nan", "--bandwidth: must be a positive finite number"),
    (f"{_PLAN} --policies lru,belady", "'belady' is a bound"),
    (f"{_PLAN} --policies lru,LRU", "policies repeat lru"),
    (f"{_PLAN} --policies fifo", "unknown runtime policy 'fifo'"),
    (f"{_PLAN} --plot {{missing}}/p.png", "the folder .*missing does not exist"),
    (f"{_PLAN} --plot {{folder}}/p.svg", "must name a .png file"),
    (f"{_PLAN} --csv {{missing}}/x.csv", "the folder .*missing does not exist"),
    (f"{_PLAN} --layers 1", "--layers 1 is fewer than the 2 MoE layers"),
    (f"{_PLAN} --num-experts 3", "must be in \\[-1, 3\\)"),
    (f"{_PLAN} --manifest {{odd_manifest}}", "not allowed with argument"),
    ("plan --trace {trace} --manifest {odd_manifest} --gpu-budget 1", "'expert_bytes' must be a positive integer"),
    ("plan --trace {trace} --manifest {old_manifest} --gpu-budget 1", "not an expertcache manifest"),
    ("plan --trace {trace} --manifest {missing}/m.json --gpu-budget 1", "no such file"),
    ("plan --trace {trace} --manifest {folder} --gpu-budget 1", "is a directory"),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, str]:
    """The files the cases name: a good trace, and every kind of bad one."""
    folder = tmp_path_factory.mktemp("cli_errors")
    ids = np.random.default_rng(0).random((20, 2, 8)).argsort(axis=2)[..., :2]
    files = {"folder": folder / "empty_folder", "missing": folder / "missing"}
    files["folder"].mkdir()
    files["trace"] = RoutingTrace(ids, list(range(20)), num_experts=8).save(folder / "trace.npz")
    files["empty_trace"] = RoutingTrace(np.zeros((0, 2, 2), int), [], num_experts=8).save(folder / "empty.npz")
    files["text_npz"] = folder / "text.npz"
    files["text_npz"].write_text("token,layer,experts\n0,0,1 2\n")
    files["bad_jsonl"] = folder / "bad.jsonl"
    files["bad_jsonl"].write_bytes(b'{"prompt_id": 1, "token_pos": 0, "layer": 0, "experts": [1, 2]}\n\xff\n')
    for name, config in [("no_weights", '{"model_type": "qwen2_moe"}'), ("bad_config", '{"model_type": '),
                         ("not_a_config", "[1, 2]")]:  # fmt: skip
        files[name] = folder / name
        files[name].mkdir()
        (files[name] / "config.json").write_text(config)
    files["bad_manifest"] = folder / "bad_manifest.json"
    files["bad_manifest"].write_text("{nope")
    files["odd_manifest"] = folder / "odd_manifest.json"
    fields = dict(num_slots=1, pool_gpu_bytes=0, host_bytes=0, pinned_host_bytes=0, full_residency_gpu_bytes=0,
                  gpu_bytes_freed=0, device="cpu")  # fmt: skip
    files["odd_manifest"].write_text(
        json.dumps({"manifest_version": 2, "tensors": [], "expert_bytes": "12", "experts": 8, "layers": 1, **fields})
    )
    files["old_manifest"] = folder / "old_manifest.json"  # version 1 said record_bytes
    files["old_manifest"].write_text(json.dumps({"manifest_version": 1, "record_bytes": 12, "experts": 8, "layers": 1}))
    return {name: str(path) for name, path in files.items()}


def _argv(case: str, files: dict[str, str]) -> list[str]:
    return [part.format(**files) for part in shlex.split(case)]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "expertcache.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)


@pytest.fixture(scope="module")
def subprocess_results(bad_files) -> list[subprocess.CompletedProcess]:
    """Every subprocess case, run several at a time (each pays Python's and torch's start-up)."""
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return list(pool.map(_run, (_argv(case, bad_files) for case, _ in SUBPROCESS_CASES)))


def _check_one_line(stderr: str, argv: list[str], expected: str) -> None:
    lines = stderr.splitlines()
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, f"{argv}: stderr has {len(lines)} lines:\n{stderr}"
    command = f"expertcache {argv[0]}" if argv and argv[0] in COMMANDS else "expertcache"
    assert lines[0].startswith(f"{command}: error: "), lines[0]
    assert re.search(expected, lines[0]), f"{expected!r} not in {lines[0]!r}"


def refused_in_one_line(argv: list[str], capsys, expected: str) -> None:
    """``main(argv)`` exits 2 (returned, or the parser's SystemExit) with one stderr line
    matching ``expected`` (`_check_one_line`) and prints nothing on stdout."""
    try:
        status = main(argv)
    except SystemExit as exit_info:  # the parser's refusals
        status = exit_info.code
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.out == ""
    _check_one_line(captured.err, argv, expected)


@pytest.mark.parametrize("index", range(len(SUBPROCESS_CASES)), ids=[case[:60] for case, _ in SUBPROCESS_CASES])
def test_a_bad_invocation_exits_2_with_one_line(index, subprocess_results, bad_files):
    case, expected = SUBPROCESS_CASES[index]
    result = subprocess_results[index]
    argv = _argv(case, bad_files)
    assert result.returncode == 2, (argv, result.returncode, result.stderr)
    assert result.stdout == ""
    _check_one_line(result.stderr, argv, expected)


@pytest.mark.parametrize(("case", "expected"), IN_PROCESS_CASES, ids=[case[:60] for case, _ in IN_PROCESS_CASES])
def test_more_bad_invocations_in_process(case, expected, bad_files, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = _argv(case, bad_files)
    try:
        status = main(argv)
    except SystemExit as exit_info:  # the parser's refusals
        status = exit_info.code
    assert status == 2
    _check_one_line(capsys.readouterr().err, argv, expected)


def test_every_command_is_in_the_tables():
    from expertcache.cli import build_parser

    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    tried = {case.split()[0] for case, _ in SUBPROCESS_CASES if case}
    assert set(subparsers.choices) == set(COMMANDS) <= tried
