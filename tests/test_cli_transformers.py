"""The command line: engine flags, ``expertcache generate`` on a saved checkpoint, the demo.

Bad requests fail at once with a message naming the problem (argparse's exit status 2).
"""

from __future__ import annotations

import argparse
import re

import pytest
import torch
from test_cli_errors import refused_in_one_line
from transformers_helpers import TINY

from expertcache.cli import add_cache_arguments, cache_config_from_args, main
from expertcache.config import DEFAULT_BUDGET, ExpertCacheConfig, parse_byte_size
from expertcache.integrations.transformers.random_models import ModelSizes
from expertcache.trace import RoutingTrace


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine")
    add_cache_arguments(parser)
    return parser


def test_flags_build_the_config():
    args = _engine_parser().parse_args(
        ["--moe-expert-cache-size", "16", "--moe-expert-cache-budget", "per-layer",
         "--moe-pin-budget", "1.5GiB"]
    )  # fmt: skip
    # no --moe-expert-cache-device: the GPU when there is one, else where the weights are
    default_device = "cuda" if torch.cuda.is_available() else None
    assert cache_config_from_args(args) == ExpertCacheConfig(
        cache_size=16, policy="lru", budget="per-layer", pin_budget_bytes=int(1.5 * 2**30), device=default_device
    )
    defaults = _engine_parser().parse_args(["--moe-expert-cache-size", "2"])
    assert cache_config_from_args(defaults).budget == DEFAULT_BUDGET
    assert cache_config_from_args(defaults).mode == "host"
    device = _engine_parser().parse_args(["--moe-expert-cache-size", "2", "--moe-expert-cache-mode", "device"])
    assert cache_config_from_args(device).mode == "device"


def test_device_mode_with_another_policy_is_refused():
    args = _engine_parser().parse_args(
        ["--moe-expert-cache-size", "2", "--moe-expert-cache-mode", "device", "--moe-expert-cache-policy", "arc"]
    )
    with pytest.raises(ValueError, match="only the lru policy"):
        cache_config_from_args(args)


def test_no_size_flag_means_no_cache():
    assert cache_config_from_args(_engine_parser().parse_args([])) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--moe-expert-cache-size", "0"], "must be at least 1"),
        (["--moe-expert-cache-size", "many"], "must be a whole number"),
        (["--moe-expert-cache-policy", "fifo"], "invalid choice"),
        (["--moe-expert-cache-budget", "all"], "invalid choice"),
        (["--moe-expert-cache-mode", "gpu"], "invalid choice"),
        (["--moe-pin-budget", "lots"], "not a byte size"),
    ],
)
def test_malformed_flags_are_rejected_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _engine_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, expected",
    [("1048576", 2**20), ("500MB", 500 * 10**6), ("64GiB", 64 * 2**30), ("1.5 kb", 1500)],
)
def test_byte_sizes(text, expected):
    assert parse_byte_size(text) == expected


def test_generate_on_a_saved_checkpoint(checkpoint, capsys, tmp_path):
    trace_file = tmp_path / "trace"  # no suffix: written and printed exactly as given
    status = main(
        ["generate", "--model", str(checkpoint), "--moe-expert-cache-size", "4",
         "--prompt", "5 6 7 8", "--max-new-tokens", "8", "--device", "cpu", "--compare",
         "--save-trace", str(trace_file)]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 0
    assert "tok/s]" not in err  # the progress bar shows on a terminal only, not in a log
    assert "2 MoE layers x 8 experts, top-2" in out
    assert "8 new tokens" in out and "hit rate" in out
    assert "without the cache: identical tokens" in out
    assert f"routing trace: 11 tokens x 2 layers -> {trace_file}\n" in out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["trace"]
    trace = RoutingTrace.load(trace_file)
    assert trace.request_starts.tolist() == [0] and trace.forward_starts.tolist() == [0, *range(4, 11)]


def test_generate_with_the_kernels_is_identical_in_passes(checkpoint, capsys):
    """2 slots per layer (top-2 of 8): the prompt runs in passes; the project's kernels give the
    uncached tokens exactly (interpreted on a CPU)."""
    status = main(
        ["generate", "--model", str(checkpoint), "--moe-expert-cache-size", "2", "--moe-expert-cache-budget",
         "per-layer", "--prompt", "5 6 7 8 9 10 11 12", "--max-new-tokens", "4", "--device", "cpu",
         "--experts-implementation", "expertcache_quant", "--compare"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0 and "without the cache: identical tokens" in out


def _generate_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--experts-implementation", "fastest"], "--experts-implementation fastest: .*batched_mm"),
        (["--moe-pin-budget", "1000"], "the pinned backing store needs \\d+ bytes .* but pin_budget_bytes is 1000"),
        (["--moe-expert-cache-compression", "exponent"], "codes bfloat16 or float16 experts .*float32"),  # fp32 model
        (["--max-new-tokens", "509"], "--max-new-tokens 509: 4 prompt tokens \\+ 509 new tokens = 513, more than "
                                      "the model's max_position_embeddings \\(512\\)"),
    ],
)  # fmt: skip
def test_generate_refuses_before_the_weights_load(checkpoint, flags, expected, capsys):
    """One line: no "Loading weights" bar before it (each was found after the load once)."""
    argv = ["generate", "--model", str(checkpoint), "--moe-expert-cache-size", "4", "--device", "cpu"]
    argv += ["--prompt", "1 2 3 4", *flags]
    refused_in_one_line(argv, capsys, expected)


def test_generate_missing_directory(tmp_path, capsys):
    err = _generate_error(["--model", str(tmp_path / "nowhere"), "--moe-expert-cache-size", "4"], capsys)
    assert "no such directory" in err


def test_generate_directory_without_checkpoint(tmp_path, capsys):
    err = _generate_error(["--model", str(tmp_path), "--moe-expert-cache-size", "4"], capsys)
    assert "no config.json" in err


def test_generate_needs_a_cache_size(checkpoint, capsys):
    assert "needs --moe-expert-cache-size" in _generate_error(["--model", str(checkpoint)], capsys)


def test_generate_refuses_slots_away_from_the_model(checkpoint, capsys):
    argv = ["--model", str(checkpoint), "--moe-expert-cache-size", "4", "--device", "cpu",
            "--moe-expert-cache-device", "cuda"]  # fmt: skip
    err = _generate_error(argv, capsys)
    if torch.cuda.is_available():
        # the flag comes back resolved to its device index
        assert re.search(r"--moe-expert-cache-device cuda(:0)? differs from the model's --device cpu", err)
    else:  # the flag itself is refused: there is no GPU to put slots on
        assert "CUDA is not available" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("size", ["1", "9"])
def test_generate_size_out_of_range(checkpoint, size, capsys):
    err = _generate_error(["--model", str(checkpoint), "--moe-expert-cache-size", size], capsys)
    assert "must be between 2 (the router's top-k) and 8 (experts per layer)" in err


def test_generate_model_without_moe_layers(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    err = _generate_error(["--model", str(tmp_path), "--moe-expert-cache-size", "4"], capsys)
    assert "has no MoE layers" in err


@pytest.mark.parametrize("text", ["hello", "1 2 999999"])
def test_generate_prompt_without_tokenizer_must_be_ids(checkpoint, text, capsys):
    err = _generate_error(["--model", str(checkpoint), "--moe-expert-cache-size", "4", "--prompt", text], capsys)
    assert "token ids" in err


def test_demo_runs_identical_and_round_trips_its_trace(capsys, tmp_path):
    from expertcache.demo import run_demo

    sizes = ModelSizes(num_moe_layers=2, num_experts=8, top_k=2, hidden=TINY.hidden)
    rows = run_demo(device="cpu", new_tokens=4, prompt_tokens=6, sizes=sizes, trace_path=tmp_path / "t.npz")
    out = capsys.readouterr().out
    assert len(rows) == 5 and all(row.identical for row in rows)
    assert "9 tokens x 2 layers x top-2" in out and "read back: identical" in out
