"""Every required family, served by the cache, generates what it generates without it.

Tiny random models (2 MoE layers, 8 experts, top-2) with a cache of 4 slots per layer, so
experts really are evicted and copied back. On the CPU in fp32: the same 16 greedy tokens
and logits within fp32 tolerance; on a GPU (marked) the same in bf16. ``disable()`` gives
back the exact model.
"""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA
from transformers_helpers import NEW_TOKENS, logits_of, prompt, tiny_model

from expertcache.config import BUDGETS
from expertcache.integrations.transformers import enable_expert_cache
from expertcache.integrations.transformers.generation import greedy_generate
from expertcache.integrations.transformers.random_models import FAMILIES

CACHE_SIZE = 4  # of 8 experts per layer

# device, dtype and the logits tolerance they bring (relative to the largest |logit|).
SETTINGS = [
    pytest.param("cpu", torch.float32, 1e-5, id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, 2e-2, id="cuda-bf16", marks=pytest.mark.gpu),
]
# device mode runs Triton kernels: on the CPU only interpreted, so with a GPU it runs there
DEVICE_MODE_SETTINGS = SETTINGS[1:] if HAS_CUDA else SETTINGS[:1]


def _generate_with_and_without(family, budget, device, dtype, mode="host"):
    model = tiny_model(family, dtype=dtype, device=device)
    if device == "cuda":  # generate() swaps grouped_mm for batched_mm on GPUs; fix one
        model.set_experts_implementation("batched_mm")
    tokens = prompt(device=device)
    reference = greedy_generate(model, tokens, NEW_TOKENS)
    reference_logits = logits_of(model, reference.tokens.to(device))
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE, budget=budget, mode=mode)
    cached = greedy_generate(model, tokens, NEW_TOKENS)
    cached_logits = logits_of(model, reference.tokens.to(device))
    return model, handle, reference, reference_logits, cached, cached_logits


@pytest.mark.parametrize("device, dtype, tolerance", SETTINGS)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("family", FAMILIES)
def test_same_tokens_and_logits_with_the_cache(family, budget, device, dtype, tolerance):
    _, handle, reference, reference_logits, cached, cached_logits = _generate_with_and_without(
        family, budget, device, dtype
    )
    assert cached.new_tokens == reference.new_tokens == NEW_TOKENS
    assert torch.equal(cached.tokens, reference.tokens)
    scale = reference_logits.abs().max().item()
    torch.testing.assert_close(cached_logits, reference_logits, rtol=0, atol=tolerance * scale)
    stats = handle.stats
    assert len(handle.layers) >= 2 and set(stats.per_layer) == set(handle.layers)
    assert stats.total.evictions > 0, "the cache must be smaller than the experts it serves"
    assert stats.total.hits + stats.total.misses > 0
    assert handle.slot_bytes < handle.expert_bytes
    handle.disable()


@pytest.mark.parametrize("device, dtype, tolerance", DEVICE_MODE_SETTINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_device_mode_gives_the_same_tokens(family, device, dtype, tolerance):
    """Admission on the device (interpreted on a CPU): same tokens, logits and LRU counts."""
    _, handle, reference, reference_logits, cached, cached_logits = _generate_with_and_without(
        family, "global", device, dtype, mode="device"
    )
    assert torch.equal(cached.tokens, reference.tokens)
    scale = reference_logits.abs().max().item()
    torch.testing.assert_close(cached_logits, reference_logits, rtol=0, atol=tolerance * scale)
    assert handle.stats.total.evictions > 0 and handle.stats.total.invalid_ids == 0
    handle.disable()


@pytest.mark.parametrize("family", FAMILIES)
def test_disable_restores_the_model_exactly(family):
    model = tiny_model(family)
    tokens = prompt()
    before = logits_of(model, tokens)
    parameters = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE)
    logits_of(model, tokens)
    handle.disable()
    assert torch.equal(logits_of(model, tokens), before)
    for name, parameter in model.named_parameters():
        original, values = parameters[name]
        assert parameter is original, f"{name} is a new Parameter object"
        assert parameter.dtype == values.dtype and parameter.device == values.device
        assert torch.equal(parameter.detach(), values), name
    assert not handle.enabled and handle.slot_bytes == 0


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_only_routed_experts_leave_the_model(family):
    """Shared experts, routers, attention stay where they were; expert tensors shrink."""
    model = tiny_model(family)
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE)
    served = tuple(f"{layer}." for layer in handle.layers)
    for name, parameter in model.named_parameters():
        is_expert = name.startswith(served) and name.count(".") == served[0].count(".")
        assert (parameter.numel() == 0) == is_expert, name
    handle.disable()


def test_gpt_oss_biases_are_cached():
    model = tiny_model("gpt_oss")
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE)
    layer = handle.layers[0]
    assert model.get_parameter(f"{layer}.gate_up_proj_bias").numel() == 0
    assert model.get_parameter(f"{layer}.down_proj_bias").numel() == 0
    handle.disable()
