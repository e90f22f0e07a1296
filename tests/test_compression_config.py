"""The ``compression`` setting end to end: `ExpertCacheConfig` validates it, the
``--moe-expert-cache-compression`` flag sets it (a bad value: one line, exit 2), and the
transformers integration builds coded stores from it (bf16 experts served exactly; fp32
ones refused when the cache is built, the model left as it was)."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers_helpers import logits_of, prompt, tiny_model

from expertcache.cli import add_cache_arguments, cache_config_from_args, main
from expertcache.config import ExpertCacheConfig
from expertcache.integrations.transformers import enable_expert_cache


@pytest.mark.parametrize("given, stored", [(None, None), ("none", None), ("exponent", "exponent")])
def test_config_takes_the_known_compressions(given, stored):
    assert ExpertCacheConfig(cache_size=4, compression=given).compression == stored


@pytest.mark.parametrize("given", ["zstd", "Exponent", "", 1, True])
def test_config_refuses_other_compressions(given):
    with pytest.raises(ValueError, match="compression must be one of none, exponent, got"):
        ExpertCacheConfig(cache_size=4, compression=given)


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    return parser.parse_args(["--moe-expert-cache-size", "4", "--moe-expert-cache-device", "cpu", *argv])


def test_the_flag_sets_the_config():
    assert cache_config_from_args(_flags()).compression is None  # default: none
    assert cache_config_from_args(_flags("--moe-expert-cache-compression", "none")).compression is None
    assert cache_config_from_args(_flags("--moe-expert-cache-compression", "exponent")).compression == "exponent"


def test_a_bad_flag_value_is_one_line_and_exit_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tmp_path), "--moe-expert-cache-size", "4",
              "--moe-expert-cache-compression", "zstd"])  # fmt: skip
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "argument --moe-expert-cache-compression: invalid choice: 'zstd'" in lines[0]
    assert lines[0].startswith("expertcache generate: error:")


@pytest.mark.parametrize("budget", ["per-layer", "global"])
def test_the_integration_serves_coded_bf16_experts_exactly(budget):
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    tokens = prompt()
    expected = logits_of(model, tokens)
    config = ExpertCacheConfig(cache_size=4, budget=budget, device="cpu", compression="exponent")
    handle = enable_expert_cache(model, config)
    try:
        stores = [handle.provider(layer).store for layer in handle.layers]
        assert all(store.compression == "exponent" and store.formats for store in stores)
        assert torch.equal(logits_of(model, tokens), expected)
        stats = handle.stats.total
        assert 0 < stats.compressed_bytes_h2d < stats.bytes_h2d  # misses moved coded bytes
    finally:
        handle.disable()
    assert torch.equal(logits_of(model, tokens), expected)


def test_the_integration_refuses_fp32_experts_and_changes_nothing():
    model = tiny_model("mixtral")  # fp32
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = ExpertCacheConfig(cache_size=4, device="cpu", compression="exponent")
    with pytest.raises(ValueError, match="codes bfloat16 or float16 experts losslessly"):
        enable_expert_cache(model, config)
    after = dict(model.named_parameters())
    assert all(torch.equal(before[name], after[name].detach()) for name in before)
