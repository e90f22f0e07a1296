"""A GPU that runs out of memory under ``expertcache generate`` or ``demo`` ends the command
with one line and exit status 2 (it was a traceback): how much torch tried to allocate and
which flags ask for less. Other RuntimeErrors are bugs and keep their traceback.

On the CPU the out-of-memory error is raised where generation runs (a CPU allocation that
fails is a plain RuntimeError); on a GPU the process's allowed share of the GPU is cut until
moving the model there really runs out.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_generate_checkpoints import _float_checkpoint
from test_generate_mxfp4_adversarial import PREFIX, _generate

from expertcache.cli import main

#: torch's message for a CUDA allocation that fails (its first sentence is what the line keeps)
TORCH_SAYS = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use.\n"
    "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)


def _run_out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError(TORCH_SAYS)


def _assert_one_line(status, out, err, match):
    """Exit status 2 and one line on stderr (what was printed before it stays on stdout)."""
    assert status == 2, (out, err)
    assert "Traceback" not in err and "Traceback" not in out, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    assert re.search(match, lines[0]), lines[0]


def test_generate_out_of_gpu_memory_is_one_line(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr("expertcache.commands.generate_run._cached_run", _run_out_of_memory)
    _assert_one_line(
        *_generate(_float_checkpoint(tmp_path), capfd),
        r"out of GPU memory \(CUDA out of memory\. Tried to allocate 2\.00 GiB\); free memory on the GPU or ask "
        r"for less: a smaller --moe-expert-cache-size, a shorter prompt or fewer --max-new-tokens$",
    )


def test_demo_out_of_gpu_memory_names_its_own_flag(capsys, monkeypatch):
    monkeypatch.setattr("expertcache.demo.run_demo", _run_out_of_memory)
    assert main(["demo", "--device", "cpu", "--new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "expertcache demo: error: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB); "
        "free memory on the GPU or ask for less: fewer --new-tokens"
    ]


def test_another_runtime_error_keeps_its_traceback(tmp_path, capfd, monkeypatch):
    """A RuntimeError that is not the GPU's size is a bug: the command does not hide it."""

    def fail(*args, **kwargs):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr("expertcache.commands.generate_run._cached_run", fail)
    with pytest.raises(RuntimeError, match="an internal bug"):
        _generate(_float_checkpoint(tmp_path), capfd)


@pytest.mark.gpu
def test_generate_on_a_gpu_too_small_for_the_model_is_one_line(tmp_path, capfd):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    directory = _float_checkpoint(tmp_path)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1e-6)  # a few KiB: moving the model there fails
    try:
        status, out, err = _generate(directory, capfd, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    _assert_one_line(status, out, err, r"out of GPU memory \(CUDA out of memory\. Tried to allocate .*tokens$")
