"""The transformers integration's contract beyond equivalence: errors, capacity, recording.

Every error is raised before the model changes; a prefill that needs more experts than
slots still runs; every experts implementation transformers offers is served; the routing
recorder captures exactly what the routers chose.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers_helpers import NEW_TOKENS, TINY, logits_of, prompt, tiny_model

from expertcache import PinBudgetError
from expertcache.config import ExpertCacheConfig
from expertcache.integrations.transformers import (
    NoExpertsError,
    UnsupportedModelError,
    enable_expert_cache,
)
from expertcache.integrations.transformers.generation import greedy_generate
from expertcache.integrations.transformers.random_models import FAMILIES
from expertcache.kernels._launch import INTERPRETED
from expertcache.trace import RoutingRecorder, RoutingTrace


def _snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _unchanged(model, snapshot) -> bool:
    return all(torch.equal(p.detach(), snapshot[name]) for name, p in model.named_parameters())


def test_unsupported_family_is_named():
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=24, intermediate_size_mlp=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_local_experts=8, num_experts_per_tok=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match="llama4_text.*Llama4TextExperts"):
        enable_expert_cache(model, cache_size=4)


def test_model_without_moe_layers():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with pytest.raises(NoExpertsError, match="'llama' has no MoE layers"):
        enable_expert_cache(AutoModelForCausalLM.from_config(config), cache_size=4)


@pytest.mark.parametrize(
    "settings, error, message",
    [
        ({"cache_size": 1}, ValueError, "between 2 .*top-k.* and 8"),  # below top-k
        ({"cache_size": 9}, ValueError, "between 2 .* and 8"),  # more slots than experts
        ({"cache_size": 4, "budget": "sideways"}, ValueError, "budget must be one of"),
        ({"cache_size": 4, "policy": "fifo"}, ValueError, "unknown eviction policy"),
        ({"cache_size": 4, "pin_budget_bytes": 1000}, PinBudgetError, "nothing was pinned"),
        ({}, TypeError, "needs cache_size"),
    ],
)
def test_bad_settings_change_nothing(settings, error, message):
    model = tiny_model("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises(error, match=message):
        enable_expert_cache(model, **settings)
    assert _unchanged(model, snapshot)
    assert enable_expert_cache(model, cache_size=4) is not None  # and it can still be enabled


def test_config_object_and_none():
    model = tiny_model("olmoe")
    assert enable_expert_cache(model, None) is None  # the engine's flags left the cache off
    config = ExpertCacheConfig(cache_size=4, budget="per-layer")
    with pytest.raises(TypeError, match="not both"):
        enable_expert_cache(model, config, cache_size=4)
    handle = enable_expert_cache(model, config)
    assert handle.config == config
    with pytest.raises(RuntimeError, match="already enabled"):
        enable_expert_cache(model, cache_size=4)
    handle.disable()
    handle.disable()  # a second disable is a no-op


@pytest.mark.parametrize("mode", ["host", "device"] if INTERPRETED else ["host"])  # the model is on the CPU
def test_prefill_needing_more_experts_than_slots_runs_in_passes(mode):
    model = tiny_model("qwen3_moe")
    long_prompt = prompt(32)
    reference = logits_of(model, long_prompt)
    handle = enable_expert_cache(model, cache_size=TINY.top_k, budget="per-layer", mode=mode)
    cached = logits_of(model, long_prompt)
    scale = reference.abs().max().item()
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-5 * scale)
    # 32 tokens x top-2 cannot fit 2 slots: one call per layer, in passes, and each expert
    # the layer used was copied exactly once (the token pieces of old reloaded 37-56 times)
    for stats in handle.stats.per_layer.values():
        assert stats.calls == 1 and stats.hits == 0
        assert TINY.top_k < stats.misses <= TINY.num_experts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_mm_in_passes_is_bit_identical(family, dtype):
    """transformers' batched_mm over a prefill in passes: every (token, choice) row comes
    from its pass and the rows are summed once, so logits and tokens equal the uncached
    model's bit for bit (summing per-pass outputs rounded each pass's share: bf16 Mixtral's
    logits differed by 0.06)."""
    model = tiny_model(family, dtype=dtype)
    model.set_experts_implementation("batched_mm")
    _assert_passes_are_bit_identical(model, prompt(32), mode="host")


def _assert_passes_are_bit_identical(model, tokens, *, mode):
    """A per-layer cache of top-k slots (the prompt in passes): logits and greedy tokens equal
    the uncached model's bit for bit."""
    reference, expected = logits_of(model, tokens), greedy_generate(model, tokens, NEW_TOKENS).tokens
    handle = enable_expert_cache(model, cache_size=TINY.top_k, budget="per-layer", mode=mode)
    assert torch.equal(logits_of(model, tokens), reference)
    assert torch.equal(greedy_generate(model, tokens, NEW_TOKENS).tokens, expected)
    assert all(stats.misses > TINY.top_k for stats in handle.stats.per_layer.values())  # passes
    handle.disable()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_batched_mm_in_passes_under_autocast_is_bit_identical(family):
    """An fp32 model under bf16 autocast: the experts' GEMMs produce bf16 rows, weighted in
    bf16 uncached; the pair route weights them in that dtype too (in fp32 logits differed by
    0.06-1.1)."""
    model = tiny_model(family)
    model.set_experts_implementation("batched_mm")
    tokens = prompt(32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = logits_of(model, tokens)
        handle = enable_expert_cache(model, cache_size=TINY.top_k, budget="per-layer")
        assert torch.equal(logits_of(model, tokens), reference)
    handle.disable()


@pytest.mark.parametrize("mode", ["host", "device"] if INTERPRETED else ["host"])
@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_a_compiled_model_runs_the_served_experts_eagerly(mode, implementation):
    """torch.compile of a served model: the experts function is kept out of the trace
    (torch.compiler.disable), so a prompt in passes gives the eager cache's logits (traced,
    a device-mode call in passes had come out wrong without an error). eager's rounding
    follows the slot order, which the second call finds changed: close, not equal."""
    torch._dynamo.reset()
    model = tiny_model("qwen3_moe")
    model.set_experts_implementation(implementation)
    tokens = prompt(32)
    handle = enable_expert_cache(model, cache_size=TINY.top_k, budget="per-layer", mode=mode)
    expected = logits_of(model, tokens)
    with torch.no_grad():
        compiled = torch.compile(model, backend="eager")(tokens).logits
    if implementation == "batched_mm":
        assert torch.equal(compiled, expected)
    else:
        torch.testing.assert_close(compiled, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    handle.disable()
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_transformers_gemms_in_passes_on_gpu(family, implementation):
    """bf16 on CUDA, device mode: a 32-token prompt over top-k slots per layer (passes) gives
    the uncached model's logits and tokens bit for bit, through transformers' own kernels."""
    model = tiny_model(family, dtype=torch.bfloat16, device="cuda")
    model.set_experts_implementation(implementation)
    _assert_passes_are_bit_identical(model, prompt(32, device="cuda"), mode="device")


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_every_experts_implementation_runs_on_the_slots(implementation):
    model = tiny_model("gpt_oss")
    model.set_experts_implementation(implementation)
    tokens = prompt()
    reference = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=4, budget="global")
    torch.testing.assert_close(logits_of(model, tokens), reference, rtol=1e-5, atol=1e-5)
    handle.disable()
    assert model.config._experts_implementation == implementation


def test_provider_views_show_the_resident_experts():
    model = tiny_model("mixtral")
    handle = enable_expert_cache(model, cache_size=4, budget="per-layer")
    logits_of(model, prompt(1))
    for layer in handle.layers:
        provider = handle.provider(layer)
        resident = provider.resident()
        assert 0 < len(resident) <= 4
        assert all(provider.expert_in(provider.slot_of(e)) == e for e in resident)
    handle.disable()
    with pytest.raises(RuntimeError, match="disabled"):
        handle.provider(handle.layers[0])


def _router_choices(model):
    """Capture every experts module's top_k_index with forward pre-hooks (independent of
    the recorder): ``[(layer name, [T, K] ids)]`` in call order."""
    calls = []
    hooks = [
        module.register_forward_pre_hook(lambda _, args, name=name: calls.append((name, args[1].clone())))
        for name, module in model.named_modules()
        if name.endswith(".experts")
    ]
    return calls, hooks


def test_recorded_trace_matches_the_routers_and_round_trips(tmp_path):
    model = tiny_model("deepseek_v3")
    calls, hooks = _router_choices(model)
    recorder = RoutingRecorder()
    handle = enable_expert_cache(model, cache_size=4, recorder=recorder)
    recorder.begin_request()
    tokens = prompt(12)
    greedy_generate(model, tokens, NEW_TOKENS)
    for hook in hooks:
        hook.remove()
    trace = recorder.trace()
    num_tokens = tokens.shape[1] + NEW_TOKENS - 1  # the last new token is never fed back
    assert trace.expert_ids.shape == (num_tokens, 2, TINY.top_k)
    assert trace.layers.tolist() == [1, 2]  # DeepSeek-V3's layer 0 is dense
    assert trace.forward_starts.tolist() == [0, *range(12, num_tokens)]
    assert trace.request_starts.tolist() == [0]
    names = list(handle.layers)
    for column, name in enumerate(names):
        expected = np.concatenate([ids.numpy() for layer, ids in calls if layer == name])
        np.testing.assert_array_equal(trace.expert_ids[:, column], expected)
    trace.save(tmp_path / "trace.npz")
    loaded = RoutingTrace.load(tmp_path / "trace.npz")
    for field in ("expert_ids", "forward_starts", "request_starts", "layers"):
        np.testing.assert_array_equal(getattr(loaded, field), getattr(trace, field))
    assert (loaded.num_experts, loaded.model) == (TINY.num_experts, "deepseek_v3")
    handle.disable()


def test_recorder_rejects_inconsistent_calls():
    recorder = RoutingRecorder(layers=[0, 1], num_experts=8)

    def top(tokens, k):  # experts 0..k-1 for every token: a router's top-k are distinct
        return np.tile(np.arange(k, dtype=np.int64), (tokens, 1))

    recorder.record(0, top(3, 2))
    with pytest.raises(ValueError, match="routed 2 tokens"):
        recorder.record(1, top(2, 2))
    with pytest.raises(ValueError, match="not one of"):
        recorder.record(5, top(3, 2))
    with pytest.raises(ValueError, match="top-k changed"):
        recorder.record(1, top(3, 4))
