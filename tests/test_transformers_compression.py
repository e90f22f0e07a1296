"""The transformers integration with exponent-coded experts: the same outputs, fewer bytes.

A served model whose experts are stored exponent-coded (`expertcache.compression`) must
compute exactly what it computes with raw stores (the slots receive the exact 16-bit words),
copy fewer bytes over the host link, restore its experts bit for bit on ``disable()``, and
refuse non-16-bit experts before changing anything.
"""

from __future__ import annotations

import pytest
import torch
from transformers_helpers import logits_of, prompt, tiny_model

from expertcache.integrations.transformers import enable_expert_cache
from expertcache.integrations.transformers.generation import greedy_generate


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("budget", ["per-layer", "global"])
def test_coded_experts_give_the_raw_cache_outputs(family, budget):
    model = tiny_model(family, dtype=torch.bfloat16).eval()
    model.set_experts_implementation("batched_mm")
    tokens = prompt()
    expected = greedy_generate(model, tokens, 8).tokens
    expected_logits = logits_of(model, expected)
    originals = {name: p.detach().clone() for name, p in model.named_parameters()}

    runs = {}
    for compression in (None, "exponent"):
        handle = enable_expert_cache(model, cache_size=4, budget=budget, compression=compression)
        tokens_out = greedy_generate(model, tokens, 8).tokens
        runs[compression] = (tokens_out, logits_of(model, expected), handle.stats.total)
        handle.disable()
    raw, coded = runs[None], runs["exponent"]
    assert torch.equal(coded[0], raw[0]) and torch.equal(coded[0], expected)
    assert torch.equal(coded[1], raw[1])  # bit-identical logits: the slots hold the same words
    torch.testing.assert_close(coded[1], expected_logits, rtol=0, atol=0)
    assert coded[2].misses == raw[2].misses and coded[2].bytes_h2d == raw[2].bytes_h2d
    assert 0 < coded[2].compressed_bytes_h2d < 0.8 * raw[2].bytes_h2d  # fewer bytes over the link
    assert raw[2].compressed_bytes_h2d == raw[2].bytes_h2d
    for name, parameter in model.named_parameters():  # disable() put every expert back exactly
        assert torch.equal(parameter, originals[name]), name


def test_compression_of_fp32_experts_is_refused_and_changes_nothing():
    model = tiny_model("qwen3_moe")  # fp32
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="16-bit|bf16|fp16|bfloat16"):
        enable_expert_cache(model, cache_size=4, compression="exponent")
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    handle = enable_expert_cache(model, cache_size=4)  # and the model can still be served
    handle.disable()
