"""Test set-up: Triton kernels run interpreted on CPU-only machines (without the interpreter's
repeated patching, `triton_interpreter`); GPU tests are marked; the suite runs over
pytest-xdist workers when it is installed.

``TRITON_INTERPRET`` must be set before any kernel module is imported, so it happens here,
before the test modules import expertcache.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from triton_interpreter import install as skip_repeated_lang_patches  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    skip_repeated_lang_patches()  # 29% of two interpreted test files' time (tests/triton_interpreter.py)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """With pytest-xdist installed (the ``test`` extra) and no ``-n`` given, spread the suite
    over one worker per CPU (``-n auto``, ``--dist worksteal``: the interpreted tests' times
    differ a hundredfold, so workers that finish early take queued tests from busy ones): the
    README's test command and CI take a fraction of the serial time. ``-n 0`` (or ``-p
    no:xdist``) runs it serially; workers never fan out again."""
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        if config.getoption("numprocesses", None) is None and not config.getoption("collectonly"):
            config.option.numprocesses = "auto"
            if config.getoption("dist", "no") == "no":  # idle workers take tests queued on busy ones
                config.option.dist = "worksteal"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def devices() -> list:
    """Devices that device-generic tests (Triton kernels included) run on.

    Without a GPU: the CPU, kernels interpreted. With one: the GPU (marked gpu), kernels
    compiled; a compiled launcher cannot take CPU tensors, and the CUDA run covers the
    same code. Host-mode tests pinned to the CPU still run everywhere (there, without the
    interpreter, the kernels' torch references run).
    """
    return [pytest.param("cuda", marks=pytest.mark.gpu)] if HAS_CUDA else ["cpu"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2-MoE saved with save_pretrained (no tokenizer: prompts are token ids)."""
    from transformers_helpers import tiny_model

    path = tmp_path_factory.mktemp("qwen2_moe")
    tiny_model("qwen2_moe").save_pretrained(path)
    return path
