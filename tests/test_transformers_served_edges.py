"""The edges of a served model: what outlives it, what loads into it, saves it or holds it.

1. A model built from a served model's ``model.config`` holds the served model's copy of
   its config, which names the cache. It ran its own experts only while a weak registry
   knew that copy: once the served model and its handle were dropped without ``disable()``,
   or for a deep copy (or a pickle) of the other model, its forward raised "no expert cache
   serves this module", and enabling a cache on it was refused. The copy now carries the
   implementation it stands for itself.
2. ``load_state_dict`` into a served model with entries for the served experts: plain, it
   loaded every other weight and then failed on the placeholders' shapes (half loaded);
   with ``assign=True`` and placeholder-shaped entries (another served model's parameters)
   it swapped the placeholders silently, the cache serving stale experts and ``disable()``
   restoring Parameters the model no longer held. Both are refused before anything loads;
   weights of other modules load as before.
3. A refused ``save_pretrained`` had already written ``config.json`` (and created the
   folder): transformers writes the config before it asks for the state dict. It is now
   refused before anything is written.
4. ``enable_expert_cache(model.model)``: the submodule held the served copy of the config
   while the root model kept the original, so ``model.set_experts_implementation``,
   ``model.save_pretrained`` and ``model.load_state_dict`` did not see the cache. Enabling
   on a part of a model that shares its config is refused, naming the model to serve.
5. An experts implementation raising halfway through a served call (after some passes'
   copies): the error comes out, and the cache serves the next calls correctly.
"""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM
from transformers.integrations.moe import ExpertsInterface
from transformers_helpers import TINY, logits_of, multimodal_config, prompt, tiny_model

from expertcache.integrations.transformers import IMPLEMENTATION_NAME, dispatch, enable_expert_cache
from expertcache.integrations.transformers.dispatch import original_forward
from expertcache.integrations.transformers.random_models import random_config
from expertcache.kernels._launch import INTERPRETED

SAVE_MESSAGE = r"served by an expert cache.*empty placeholders.*disable\(\)"
LOAD_MESSAGE = r"load_state_dict.*served by an expert cache.*mlp\.experts\.gate_up_proj.*disable\(\)"


def _close(cached, reference):
    scale = reference.abs().max().item()
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-5 * scale)


def _state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _same(model, state) -> bool:
    now = dict(model.named_parameters())
    return now.keys() == state.keys() and all(torch.equal(now[name].detach(), state[name]) for name in state)


def _served(family: str = "qwen3_moe"):
    model = tiny_model(family).eval()
    tokens = prompt()
    reference, state = logits_of(model, tokens), _state(model)
    return model, enable_expert_cache(model, cache_size=4), tokens, reference, state


def _still_served(model, handle, tokens, reference, state) -> None:
    """The refused call changed nothing: the cache serves as before, disable() gives the model back."""
    calls = handle.stats.total.calls
    _close(logits_of(model, tokens), reference)
    assert handle.stats.total.calls == calls + TINY.num_moe_layers
    handle.disable()
    assert _same(model, state) and torch.equal(logits_of(model, tokens), reference)


# -- 1. a model of a served model's config, once that model is gone or copied -------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_model_of_a_served_config_outlives_the_served_model(family):
    served, handle, tokens, _, _ = _served(family)
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(served.config).eval()  # holds the served model's copy
    own = logits_of(other, tokens)
    gone = weakref.ref(served)
    del served, handle  # dropped without disable()
    gc.collect()
    assert gone() is None
    assert other.config._experts_implementation == IMPLEMENTATION_NAME
    assert torch.equal(logits_of(other, tokens), own)  # was: RuntimeError, no expert cache serves this module
    handle = enable_expert_cache(other, cache_size=4)  # was: "selects 'expertcache', which no expert cache serves"
    _close(logits_of(other, tokens), own)
    assert handle.stats.total.calls == TINY.num_moe_layers
    handle.disable()
    assert torch.equal(logits_of(other, tokens), own)


def _pickled(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [copy.deepcopy, _pickled], ids=["deepcopy", "torch.save"])
def test_a_copy_of_a_model_of_a_served_config_says_how_to_run(copier, tmp_path):
    """A copy of a model built from a served config holds a config that names the cache but
    no longer says which implementation it stands for (that lives beside the original
    config, not in it: a str subclass on the config broke torch.compile). Its forward says
    how to choose one; once chosen it runs as the original and can be served."""
    served, handle, tokens, reference, state = _served()
    wraps = dispatch.stands_for(served.config)
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(served.config).eval()
    own = logits_of(other, tokens)
    twin = copier(other)
    assert twin.config is not served.config and twin.config._experts_implementation == IMPLEMENTATION_NAME
    with pytest.raises(RuntimeError, match=r"set_experts_implementation"):
        logits_of(twin, tokens)
    twin.set_experts_implementation(wraps)
    assert torch.equal(logits_of(twin, tokens), own)
    twin_handle = enable_expert_cache(twin, cache_size=4)
    _close(logits_of(twin, tokens), own)
    twin_handle.disable()
    twin.save_pretrained(tmp_path)  # the cache's name is not saved: the checkpoint is an ordinary one
    assert IMPLEMENTATION_NAME not in (tmp_path / "config.json").read_text()
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(tmp_path).eval(), tokens), own)
    _still_served(served, handle, tokens, reference, state)
    assert torch.equal(logits_of(other, tokens), own)


# -- 2. load_state_dict --------------------------------------------------------------------------


def _shifted(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Other values for every weight (a partial load would show)."""
    return {name: value + 1 for name, value in state.items()}


def _placeholders_of_another_served_model() -> dict[str, torch.Tensor]:
    """Another served model's parameters: its experts are the placeholders, shape (0,)."""
    other = tiny_model("qwen3_moe")
    enable_expert_cache(other, cache_size=4)
    return {name: p.detach() if ".experts." in name else p.detach() + 1 for name, p in other.named_parameters()}


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize("entries", ["full", "placeholders"])
@pytest.mark.parametrize("into", ["", "model.layers.0"])
def test_loading_served_experts_is_refused_and_loads_nothing(entries, assign, into):
    model, handle, tokens, reference, state = _served()
    loaded = _shifted(state) if entries == "full" else _placeholders_of_another_served_model()
    target = model.get_submodule(into)
    prefix = f"{into}." if into else ""
    loaded = {name.removeprefix(prefix): value for name, value in loaded.items() if name.startswith(prefix)}
    parameters = dict(model.named_parameters())
    with pytest.raises(RuntimeError, match=LOAD_MESSAGE):
        target.load_state_dict(loaded, strict=False, assign=assign)  # was: half loaded, or silently swapped
    assert all(parameters[name] is p for name, p in model.named_parameters())  # no Parameter swapped
    _still_served(model, handle, tokens, reference, state)  # nothing loaded
    if entries == "full":  # once disabled, the same load is an ordinary one
        target.load_state_dict(loaded, strict=False, assign=assign)
        assert all(torch.equal(target.get_parameter(name), value) for name, value in loaded.items())


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_loading_other_weights_into_a_served_model_works_as_before(assign):
    model, handle, tokens, reference, state = _served()
    others = {name: value for name, value in _shifted(state).items() if ".experts." not in name}
    uncached = tiny_model("qwen3_moe").eval()  # the same seed: the same weights
    uncached.load_state_dict({name: value.clone() for name, value in others.items()}, strict=False, assign=assign)
    expected = logits_of(uncached, tokens)
    result = model.load_state_dict(others, strict=False, assign=assign)
    assert sorted(result.missing_keys) == sorted(name for name in state if ".experts." in name)
    _close(logits_of(model, tokens), expected)  # the new weights, the cached experts
    handle.disable()
    assert _same(model, _state(uncached))


# -- 3. save_pretrained ---------------------------------------------------------------------------


@pytest.mark.parametrize("part", ["", "model"], ids=["model", "model.model"])
def test_a_refused_save_pretrained_writes_nothing(part, tmp_path):
    model, handle, tokens, reference, state = _served()
    config = model.config.to_dict()
    saver = model.get_submodule(part)
    with pytest.raises(RuntimeError, match=SAVE_MESSAGE):
        saver.save_pretrained(tmp_path / "new")  # was: the folder made, config.json written, then the error
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept.txt").write_text("kept")
    with pytest.raises(RuntimeError, match=SAVE_MESSAGE):
        saver.save_pretrained(tmp_path)
    assert [path.name for path in tmp_path.iterdir()] == ["kept.txt"]
    assert model.config.to_dict() == config  # save_pretrained's dtype and architectures: not written either
    _still_served(model, handle, tokens, reference, state)
    model.save_pretrained(tmp_path / "after")  # once disabled: the whole model
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(tmp_path / "after").eval(), tokens), reference)


# -- 4. a part of a model -----------------------------------------------------------------------------


def _configs_of(model) -> set[int]:
    return {id(module.config) for module in model.modules() if hasattr(module, "config")}


def test_enabling_on_a_part_of_a_model_is_refused_and_changes_nothing():
    model = tiny_model("qwen3_moe")
    tokens = prompt()
    reference, state, configs = logits_of(model, tokens), _state(model), _configs_of(model)
    message = (
        r"Qwen3MoeModel is part of a Qwen3MoeForCausalLM that shares its config.*"
        r"enable_expert_cache on the Qwen3MoeForCausalLM.*nothing was changed"
    )
    with pytest.raises(ValueError, match=message):  # was: served, the root model's config left unaware
        enable_expert_cache(model.model, cache_size=4)
    assert _configs_of(model) == configs and _same(model, state)
    assert model.config._experts_implementation != IMPLEMENTATION_NAME
    assert torch.equal(logits_of(model, tokens), reference)
    handle = enable_expert_cache(model, cache_size=4)  # the whole model
    model.set_experts_implementation("batched_mm")
    _close(logits_of(model, tokens), reference)
    handle.disable()
    assert model.config._experts_implementation == "batched_mm" and _same(model, state)


def _multimodal():
    """A Qwen3-VL-MoE model: its experts under ``text_config``, a sub-config of the model's."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(0)
    return Qwen3VLMoeForConditionalGeneration(multimodal_config()).eval()


def test_enabling_on_the_text_tower_of_a_model_is_refused():
    model = _multimodal()
    tower = model.model.language_model  # holds text_config, which the model's config holds
    configs = _configs_of(model)
    message = r"Qwen3VLMoeTextModel is part of a Qwen3VLMoeForConditionalGeneration that shares its config"
    with pytest.raises(ValueError, match=message):
        enable_expert_cache(tower, cache_size=4)
    assert _configs_of(model) == configs
    enable_expert_cache(model, cache_size=4).disable()


def test_a_model_of_its_own_sharing_a_config_is_served():
    """Not a part: a base model built on its own from a config another model holds too."""
    config = random_config("qwen3_moe", TINY)
    head = AutoModelForCausalLM.from_config(config).eval()
    torch.manual_seed(0)
    base = AutoModel.from_config(config).eval()
    tokens = prompt()
    with torch.no_grad():
        expected = base(tokens).last_hidden_state
    handle = enable_expert_cache(base, cache_size=4)
    with torch.no_grad():
        _close(base(tokens).last_hidden_state, expected)
    assert head.config is config and config._experts_implementation != IMPLEMENTATION_NAME
    handle.disable()


# -- 5. an implementation that raises halfway through a call -------------------------------------------


class _FailingOnce:
    """An experts implementation: the module's own forward, raising at the ``at``-th call once armed."""

    def __init__(self, eager) -> None:
        self.eager = eager
        self.countdown = 0

    def __call__(self, module, hidden_states, top_k_index, top_k_weights):
        self.countdown -= 1
        if self.countdown == 0:
            raise RuntimeError("the implementation failed")
        return self.eager(module, hidden_states, top_k_index, top_k_weights)


@pytest.mark.parametrize("mode", ["host", "device"] if INTERPRETED else ["host"])
@pytest.mark.parametrize("failing_call", [1, 3], ids=["first-pass", "third-pass"])
def test_a_call_failing_halfway_leaves_a_cache_that_serves_correctly(mode, failing_call, monkeypatch):
    model = tiny_model("qwen3_moe")
    failing = _FailingOnce(original_forward(model.get_submodule("model.layers.0.mlp.experts")))
    monkeypatch.setitem(ExpertsInterface._global_mapping, "failing", failing)
    model.set_experts_implementation("failing")  # registered: transformers takes it
    tokens = prompt(32)  # 32 tokens x top-2 over 2 slots: several passes a layer
    reference = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=TINY.top_k, budget="per-layer", mode=mode)
    failing.countdown = failing_call
    with pytest.raises(RuntimeError, match="the implementation failed"):
        logits_of(model, tokens)  # layer 0's call: its first passes' experts already copied
    for layer in handle.layers:
        assert len(handle.provider(layer).resident()) <= TINY.top_k
    for _ in range(2):  # the next calls: the slots hold what the bookkeeping says
        _close(logits_of(model, tokens), reference)
    handle.disable()
    _close(logits_of(model, tokens), reference)
