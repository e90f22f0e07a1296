"""Three fixes of a review: ``plan --manifest`` takes the manifest's layer count, a raw Mixtral
routing log of one layer loads, and `deferred_interrupts` leaves a SIGINT handler installed
from C alone."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import random_weights
from test_cli_inputs import _manifest, _refused
from test_plan import _trace

import expertcache
from expertcache import CachedWeightProvider
from expertcache.cli import main
from expertcache.manifest import build_manifest
from expertcache.trace import load_trace

# -- plan --manifest: the manifest's layers ------------------------------------------------


def _model_manifest(path: Path, layers: int) -> int:
    """Write the manifest of a model of ``layers`` cached layers (8 experts each); its expert bytes."""
    providers = [CachedWeightProvider(random_weights(8, 16, 8), cache_size=2, device="cpu") for _ in range(layers)]
    manifest = build_manifest(providers)
    manifest.write(path)
    return manifest.expert_bytes


def _plan(tmp_path: Path, capsys, *flags: str) -> tuple[str, list[dict]]:
    """``expertcache plan`` on ``trace.npz`` with ``flags``: its output and its CSV rows."""
    args = ["plan", "--trace", str(tmp_path / "trace.npz"), "--no-progress", "--csv", str(tmp_path / "plan.csv")]
    assert main([*args, *flags]) == 0
    return capsys.readouterr().out, list(csv.DictReader(open(tmp_path / "plan.csv")))


@pytest.mark.parametrize("traced", [1, 2])  # a one-layer trace, a few layers of the model
def test_a_model_manifest_splits_the_budget_over_all_its_layers(traced, tmp_path, capsys):
    """A 4-layer manifest and a trace of fewer layers plan as ``--layers 4`` does, and say so."""
    record = _model_manifest(tmp_path / "manifest.json", layers=4)
    _trace(layers=traced).save(tmp_path / "trace.npz")
    budget = ["--gpu-budget", str(8 * record / 1e9)]  # 8 slots: 2 a layer over 4 (not 8 // traced)
    out, rows = _plan(tmp_path, capsys, "--manifest", str(tmp_path / "manifest.json"), *budget)
    assert "recommendation: --moe-expert-cache-size 2 " in out
    says = [line for line in out.splitlines() if line.startswith("model layers 4 (from --manifest")]
    assert len(says) == 1 and f"the trace records {traced}" in says[0], out
    assert {(row["traced_layers"], row["model_layers"]) for row in rows} == {(str(traced), "4")}
    same, same_rows = _plan(tmp_path, capsys, "--expert-bytes", str(record), "--layers", "4", *budget)
    assert out[out.index("hit rate (%)") :] == same[same.index("hit rate (%)") :]  # table and recommendation
    assert rows == same_rows


def test_layers_equal_to_the_manifests_are_taken(tmp_path, capsys):
    record = _model_manifest(tmp_path / "manifest.json", layers=4)
    _trace().save(tmp_path / "trace.npz")
    flags = ["--manifest", str(tmp_path / "manifest.json"), "--layers", "4", "--gpu-budget", str(8 * record / 1e9)]
    out, rows = _plan(tmp_path, capsys, *flags)
    assert "recommendation: --moe-expert-cache-size 2 " in out
    assert {row["model_layers"] for row in rows} == {"4"}


@pytest.mark.parametrize(
    ("manifest_layers", "flags", "expected"),
    [
        (2, [], "manifest.json covers 2 MoE layers, fewer than the 3 the trace records"),  # trace of 3 layers
        (4, ["--layers", "6"], "--layers 6 disagrees with --manifest .*manifest.json, which covers 4 MoE layers"),
        (4, ["--layers", "3"], "--layers 3 disagrees with --manifest .*manifest.json, which covers 4 MoE layers"),
    ],
    ids=["trace has more layers", "--layers above the manifest's", "--layers below the manifest's"],
)
def test_a_manifest_of_other_layers_is_refused_in_one_line(manifest_layers, flags, expected, tmp_path, capsys):
    _manifest(tmp_path / "manifest.json", layers=manifest_layers, experts=8 * manifest_layers)
    _trace(layers=3).save(tmp_path / "trace.npz")
    argv = ["plan", "--trace", str(tmp_path / "trace.npz"), "--manifest", str(tmp_path / "manifest.json")]
    argv += ["--gpu-budget", "6e-6", "--no-progress", "--csv", str(tmp_path / "plan.csv"), *flags]
    _refused(argv, capsys, expected)
    assert not (tmp_path / "plan.csv").exists()


# -- a raw Mixtral routing log of one layer --------------------------------------------------


def _raw_log(path: Path, records: list[tuple[int, int, list[int]]]) -> Path:
    """A raw routing log (``routing_raw.jsonl``'s format) of ``(layer, token_pos, experts)`` records."""
    lines = [
        {"dataset": "humaneval", "problem_id": 0, "layer": layer, "token_pos": position, "experts": experts,
         "gating_probs": [0.6, 0.4]}
        for layer, position, experts in records
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("prompt", [1, 3])  # a one-token prefill: its record and the first step's look alike
def test_a_raw_log_of_one_layer_loads(prompt, tmp_path):
    """One layer: the prefill is token_pos 0..P-1 at layer 7, then one record a decode step (token_pos 0)."""
    prefill = [(7, position, [position % 8, (position + 1) % 8]) for position in range(prompt)]
    decode = [(7, 0, [step, step + 4]) for step in range(2)]
    trace = load_trace(_raw_log(tmp_path / "routing_raw.jsonl", prefill + decode))
    assert trace.layers.tolist() == [7]
    assert trace.expert_ids.shape == (prompt + 2, 1, 2)
    assert trace.expert_ids[:, 0].tolist() == [experts for _, _, experts in prefill + decode]
    assert trace.forward_starts.tolist() == [0, prompt, prompt + 1]
    assert trace.request_starts.tolist() == [0]
    assert f"Prefill of {prompt} tokens (one forward), then 2 decode steps" in trace.notes


def test_a_raw_log_whose_first_step_lost_its_first_layer_loads(tmp_path):
    """The first decode step's layer-0 record was dropped: the log goes from layer 1 back to
    layer 1's token_pos 0, which only a decode step can do."""
    records = [(0, 0, [0, 1]), (0, 1, [1, 2]), (1, 0, [2, 3]), (1, 1, [3, 4])]  # prefill of 2 tokens
    records += [(1, 0, [4, 5]), (0, 0, [5, 6]), (1, 0, [6, 7])]  # step 1 lost layer 0; step 2 whole
    trace = load_trace(_raw_log(tmp_path / "routing_raw.jsonl", records))
    assert trace.expert_ids.tolist() == [
        [[0, 1], [2, 3]],
        [[1, 2], [3, 4]],
        [[-1, -1], [4, 5]],
        [[5, 6], [6, 7]],
    ]
    assert trace.forward_starts.tolist() == [0, 2, 3]


def test_a_repeated_prefill_record_of_one_layer_is_still_refused(tmp_path):
    path = _raw_log(tmp_path / "routing_raw.jsonl", [(0, 0, [0, 1]), (0, 1, [1, 2]), (0, 1, [2, 3]), (0, 0, [3, 4])])
    with pytest.raises(ValueError, match="routing_raw.jsonl:3: a second prefill record for token_pos 1 at layer 0"):
        load_trace(path)


# -- deferred_interrupts under a SIGINT handler installed from C ------------------------------

_HOST = r"""
#include <Python.h>
#include <signal.h>
#include <stdio.h>

static volatile sig_atomic_t interrupts = 0;
static void on_interrupt(int signum) { (void)signum; interrupts++; }

/* An application embedding Python with a SIGINT handler of its own: Python finds it at
   start-up and leaves it (signal.getsignal(SIGINT) is None). */
int main(int argc, char **argv) {
    if (argc != 2) return 64;
    signal(SIGINT, on_interrupt);
    Py_Initialize();
    int failed = PyRun_SimpleString(argv[1]);
    struct sigaction now;
    sigaction(SIGINT, NULL, &now);
    if (Py_FinalizeEx() < 0) failed = 1;
    printf("host handler %s, %d interrupt(s)\n", now.sa_handler == on_interrupt ? "kept" : "replaced",
           (int)interrupts);
    return failed ? 1 : 0;
}
"""

_SCRIPT = """
import signal, sys
sys.path[:0] = {path!r}
import torch
from expertcache import CachedWeightProvider
from expertcache.call_guards import deferred_interrupts

assert signal.getsignal(signal.SIGINT) is None  # the host's handler, installed from C
with deferred_interrupts():
    signal.raise_signal(signal.SIGINT)  # the host's handler takes it, at once
weights = {{"w1": torch.zeros(4, 6, 3), "w2": torch.zeros(4, 3, 3)}}
provider = CachedWeightProvider(weights, cache_size=2, device="cpu")
provider.prepare(torch.tensor([[0, 1]]))  # a host-mode call: inside deferred_interrupts
assert provider.stats.misses == 2, provider.stats
assert signal.getsignal(signal.SIGINT) is None
"""


def _embedding_host(folder: Path) -> Path:
    """The host program above, compiled against this interpreter's libpython (skip if it cannot be)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    include = Path(sysconfig.get_paths()["include"])
    if compiler is None or not (include / "Python.h").is_file() or not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        pytest.skip("needs a C compiler, Python.h and a shared libpython to embed Python")
    library = sysconfig.get_config_var("LIBDIR")
    (folder / "host.c").write_text(_HOST)
    command = [compiler, str(folder / "host.c"), "-o", str(folder / "host"), f"-I{include}", f"-L{library}"]
    command += [f"-lpython{sysconfig.get_config_var('LDVERSION')}", f"-Wl,-rpath,{library}"]
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode:
        pytest.skip(f"could not build an embedding host: {built.stderr[-300:]}")
    return folder / "host"


def test_a_sigint_handler_installed_from_c_is_left_alone(tmp_path):
    host = _embedding_host(tmp_path)
    path = [str(Path(expertcache.__file__).parents[1]), *sys.path]
    environment = {**os.environ, "PYTHONHOME": sys.base_prefix}
    result = subprocess.run(
        [str(host), _SCRIPT.format(path=path)], capture_output=True, text=True, env=environment, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "host handler kept, 1 interrupt(s)", result.stdout
