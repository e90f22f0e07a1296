"""Served models are independent of each other, and served experts are inference only.

1. Two models built from one config object (``from_config(config)`` and ``Model(config)``
   do not copy it): enabling the cache on one named ``"expertcache"`` in the shared config,
   so the other's next forward raised (no cache serves its modules) and enabling the cache
   on it too was refused. Each served model now holds its own copies of its config objects:
   the other keeps its own experts, outputs and config, and each enables and disables alone.
2. A backward through served experts failed inside autograd ("modified by an inplace
   operation"). It now raises an error naming the cause, and the cache is as it was and
   keeps serving. A forward with gradients enabled still runs (``torch.no_grad()``
   forgotten), with or without parameters requiring grad, as do ``inference_mode`` and
   ``generate()``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers_helpers import NEW_TOKENS, TINY, logits_of, multimodal_config, prompt, tiny_model

from expertcache.integrations.transformers import IMPLEMENTATION_NAME, enable_expert_cache
from expertcache.integrations.transformers.random_models import random_config


def _twins(family: str):
    """One config object and two models built from it (seeds 0 and 1: different weights)."""
    config = random_config(family, TINY)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(AutoModelForCausalLM.from_config(config).eval())
    assert all(module.config is config for model in models for module in model.modules() if hasattr(module, "config"))
    return config, models


def _expert_weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".experts." in name}


def _same_weights(model, snapshot) -> bool:
    now = dict(model.named_parameters())
    return all(torch.equal(now[name].detach(), value) for name, value in snapshot.items())


def _close(cached, reference):
    scale = reference.abs().max().item()
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-5 * scale)


def _resident(handle) -> dict[str, frozenset[int]]:
    return {layer: handle.provider(layer).resident() for layer in handle.layers}


def _configs_of(model) -> set[int]:
    return {id(module.config) for module in model.modules() if hasattr(module, "config")}


# -- 1. two models from one config object ----------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_serving_one_model_leaves_a_model_of_the_same_config_alone(family):
    config, (served, other) = _twins(family)
    tokens = prompt()
    reference, own = logits_of(served, tokens), logits_of(other, tokens)
    implementation = dict(other.get_experts_implementation())
    handle = enable_expert_cache(served, cache_size=4)
    assert torch.equal(logits_of(other, tokens), own)  # was: RuntimeError, no expert cache serves this module
    assert dict(other.get_experts_implementation()) == implementation and _configs_of(other) == {id(config)}
    assert served.config._experts_implementation == IMPLEMENTATION_NAME  # the served model's own config says so
    _close(logits_of(served, tokens), reference)
    calls = handle.stats.total.calls
    logits_of(other, tokens)
    assert handle.stats.total.calls == calls  # the other model ran its own experts, not the cache
    handle.disable()
    assert _configs_of(served) == {id(config)} and dict(served.get_experts_implementation()) == implementation
    assert torch.equal(logits_of(served, tokens), reference)
    assert torch.equal(logits_of(other, tokens), own)


@pytest.mark.parametrize("first", [0, 1], ids=["first-enabled-disabled-first", "second-enabled-disabled-first"])
def test_each_model_of_one_config_enables_and_disables_on_its_own(first):
    config, models = _twins("qwen3_moe")
    tokens = prompt()
    references = [logits_of(model, tokens) for model in models]
    snapshots = [_expert_weights(model) for model in models]
    implementation = dict(models[0].get_experts_implementation())
    handles = [enable_expert_cache(model, cache_size=4) for model in models]  # was: the second refused
    for model, reference in zip(models, references, strict=True):
        _close(logits_of(model, tokens), reference)
    assert [handle.stats.total.calls for handle in handles] == [TINY.num_moe_layers] * 2  # each its own cache
    kept = 1 - first
    handles[first].disable()
    assert dict(models[first].get_experts_implementation()) == implementation
    assert _configs_of(models[first]) == {id(config)} and _same_weights(models[first], snapshots[first])
    assert torch.equal(logits_of(models[first], tokens), references[first])
    assert handles[kept].enabled and models[kept].config._experts_implementation == IMPLEMENTATION_NAME
    calls = handles[kept].stats.total.calls
    _close(logits_of(models[kept], tokens), references[kept])  # still served, by its own cache
    assert handles[kept].stats.total.calls == calls + TINY.num_moe_layers
    handles[kept].disable()
    assert _configs_of(models[kept]) == {id(config)} and _same_weights(models[kept], snapshots[kept])
    assert dict(models[kept].get_experts_implementation()) == implementation


def _multimodal_twins():
    """Two Qwen3-VL-MoE models of one composite config (the experts under ``text_config``)."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    config = multimodal_config()
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(Qwen3VLMoeForConditionalGeneration(config).eval())
    return config, models


def test_a_composite_config_is_copied_whole():
    """The served model's ``config.text_config`` is its text model's config (transformers
    matches them by identity), so ``set_experts_implementation`` reaches the served blocks;
    the other model and the shared config objects are untouched until disable()."""
    config, (served, other) = _multimodal_twins()
    tokens = prompt()
    with torch.no_grad():
        reference, own = served(input_ids=tokens).logits, other(input_ids=tokens).logits
    implementation = dict(other.get_experts_implementation())
    handle = enable_expert_cache(served, cache_size=4)
    with torch.no_grad():
        assert torch.equal(other(input_ids=tokens).logits, own)  # was: RuntimeError, no expert cache serves it
    assert dict(other.get_experts_implementation()) == implementation
    assert served.get_experts_implementation()["text_config"] == IMPLEMENTATION_NAME
    assert served.config.text_config is served.model.language_model.config
    served.set_experts_implementation("batched_mm")  # followed while served, on the served model only
    calls = handle.stats.total.calls
    with torch.no_grad():
        _close(served(input_ids=tokens).logits, reference)
    assert handle.stats.total.calls == calls + TINY.num_moe_layers
    assert dict(other.get_experts_implementation()) == implementation  # the shared objects: not switched
    handle.disable()
    assert served.config is config and served.model.language_model.config is config.text_config
    assert served.get_experts_implementation()["text_config"] == "batched_mm"  # the choice stays, as uncached


def test_one_model_gets_its_config_object_back_with_what_changed_while_served():
    """The ordinary case is as before: once disabled, the model holds the object it was
    built from, carrying an implementation chosen while served and any other change."""
    model = tiny_model("olmoe")
    config = model.config
    tokens = prompt()
    reference = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=4)
    model.set_experts_implementation("batched_mm")  # followed while served
    model.config.use_cache = False
    _close(logits_of(model, tokens), reference)
    assert model.config._experts_implementation == IMPLEMENTATION_NAME
    handle.disable()
    assert _configs_of(model) == {id(config)}
    assert config._experts_implementation == "batched_mm" and config.use_cache is False


# -- 2. backward through served experts ------------------------------------------------------


@pytest.mark.parametrize("requires_grad", ["parameters", "inputs"])
def test_backward_through_served_experts_is_refused_and_changes_nothing(requires_grad):
    model = tiny_model("qwen3_moe")  # parameters require grad, as from_pretrained leaves them
    tokens = prompt()
    reference = logits_of(model, tokens)
    snapshot = _expert_weights(model)
    handle = enable_expert_cache(model, cache_size=4)
    if requires_grad == "inputs":
        model.requires_grad_(False)
        embeddings = model.get_input_embeddings()(tokens).detach().requires_grad_()
        logits = model(inputs_embeds=embeddings).logits
    else:
        logits = model(tokens).logits  # gradients enabled: torch.no_grad() forgotten
    assert logits.requires_grad
    _close(logits.detach(), reference)  # the forward runs
    stats, resident = handle.stats, _resident(handle)
    message = (
        r"backward through layer \d's Qwen3MoeExperts, served by an expert cache: the cache is for inference "
        r"only .*torch.no_grad\(\) or torch.inference_mode\(\).*disable\(\)"
    )
    with pytest.raises(RuntimeError, match=message):  # was: "modified by an inplace operation"
        logits.sum().backward()
    assert handle.stats == stats and _resident(handle) == resident  # the cache as it was
    _close(logits_of(model, tokens), reference)  # and it keeps serving
    assert handle.stats.total.calls == stats.total.calls + TINY.num_moe_layers
    handle.disable()
    assert _same_weights(model, snapshot)


def test_inference_runs_with_gradients_enabled_inference_mode_and_generate():
    model = tiny_model("qwen3_moe")
    tokens = prompt()
    reference = logits_of(model, tokens)
    greedy = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(tokens, attention_mask=torch.ones_like(tokens), **greedy)
    handle = enable_expert_cache(model, cache_size=4)
    assert torch.equal(model.generate(tokens, attention_mask=torch.ones_like(tokens), **greedy), expected)
    with torch.inference_mode():
        _close(model(tokens).logits, reference)
    model.requires_grad_(False)
    logits = model(tokens).logits  # gradients enabled, nothing requires grad
    assert not logits.requires_grad
    _close(logits, reference)
    assert handle.stats.total.calls > 0
    handle.disable()
