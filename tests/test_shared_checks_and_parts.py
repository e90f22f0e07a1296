"""One expert-id range rule for every path, and enabling the cache on a module that wraps a model.

1. The id range check lived in copies: a host-mode call of few ids named the first id out
   of range, a call of many ids (keys found on the device) and the providers' CPU check the
   smallest when it was negative, else the largest. The same ids now raise the same error on
   every path (`validation.check_id_bounds`), and the cache is as before.
2. A module wrapping a part of a model (``Wrapper(causal_lm.model)``) holds no config of its
   own, so the part check let it through and the part was served with the causal LM unaware
   (``save_pretrained`` wrote ``config.json`` before it failed, as for the part itself). It is
   refused like the part. A module wrapping a whole model is served like the model.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_weights
from torch import nn
from transformers_helpers import TINY, logits_of, multimodal_config, prompt, tiny_model

from expertcache import CachedWeightProvider, FullGPUProvider
from expertcache.host_prepare import DEVICE_KEYS_MIN_IDS
from expertcache.integrations.transformers import IMPLEMENTATION_NAME, enable_expert_cache

NUM_EXPERTS, HIDDEN, INTER = 8, 8, 4

# -- 1. one range rule ------------------------------------------------------------------------------


def _ids(rows: int) -> torch.Tensor:
    """``[rows, 2]`` valid ids with one too large (row 0) before one negative (the last row)."""
    ids = torch.arange(rows * 2).reshape(rows, 2) % NUM_EXPERTS
    ids[0, 0], ids[-1, 1] = NUM_EXPERTS, -1
    return ids


def test_every_path_names_the_same_id_out_of_range():
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER)
    cache = CachedWeightProvider(weights, cache_size=4, device="cpu", mode="host")
    cache.prepare(torch.tensor([[1, 2], [3, 2]]))
    before = (cache.stats, cache.resident())
    message = rf"^expert id -1 in topk_ids is outside \[0, {NUM_EXPERTS}\)$"
    # keys found on the host (few ids; was: id 8, the first out of range) / on the device (many ids)
    for rows in (2, DEVICE_KEYS_MIN_IDS // 2):
        with pytest.raises(IndexError, match=message):
            cache.prepare(_ids(rows))
        with pytest.raises(IndexError, match=message):
            FullGPUProvider(weights).prepare(_ids(rows))
    assert (cache.stats, cache.resident()) == before
    result = cache.prepare(torch.tensor([[5, 1]]))  # keeps serving
    assert torch.equal(result.w1[result.topk_ids[0, 0]], weights["w1"][5])


# -- 2. a module wrapping a model ---------------------------------------------------------------------


class Wrapper(nn.Module):
    """A plain module holding a model (no config of its own), as an application's would."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, tokens: torch.Tensor):
        return self.inner(tokens)


def _state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _same(model, state) -> bool:
    now = dict(model.named_parameters())
    return now.keys() == state.keys() and all(torch.equal(now[name].detach(), state[name]) for name in state)


def _configs_of(model) -> list[int]:
    return [id(module.config) for module in model.modules() if hasattr(module, "config")]


def _close(cached, reference):
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-5 * reference.abs().max().item())


def test_a_module_wrapping_a_whole_model_is_served_and_given_back():
    model = tiny_model("qwen3_moe").eval()
    wrapper, tokens = Wrapper(model), prompt()
    reference, state, configs = logits_of(model, tokens), _state(model), _configs_of(model)
    handle = enable_expert_cache(wrapper, cache_size=4)
    assert model.config._experts_implementation == IMPLEMENTATION_NAME  # the model's own copy
    _close(logits_of(wrapper, tokens), reference)
    _close(logits_of(model, tokens), reference)  # called directly, the model is served too
    assert handle.stats.total.calls == 2 * TINY.num_moe_layers
    with pytest.raises(RuntimeError, match="already enabled"):
        enable_expert_cache(model, cache_size=4)
    handle.disable()
    assert _configs_of(model) == configs and _same(model, state)
    assert model.config._experts_implementation != IMPLEMENTATION_NAME
    assert torch.equal(logits_of(wrapper, tokens), reference)


def _multimodal():
    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(0)
    return Qwen3VLMoeForConditionalGeneration(multimodal_config()).eval()


@pytest.mark.parametrize(
    "build, part, outer",
    [
        (lambda: tiny_model("qwen3_moe").eval(), "model", "Qwen3MoeForCausalLM"),  # holds config
        (_multimodal, "model.language_model", "Qwen3VLMoeForConditionalGeneration"),  # holds a sub-config
    ],
    ids=["causal-lm", "text-tower"],
)
def test_a_module_wrapping_a_part_of_a_model_is_refused_and_changes_nothing(build, part, outer, tmp_path):
    model = build()
    state, configs = _state(model), _configs_of(model)
    message = rf"Wrapper holds a part of a {outer} that shares its config.*enable_expert_cache on the {outer}.*nothing"
    with pytest.raises(ValueError, match=message):  # was: the part served, the outer model unaware
        enable_expert_cache(Wrapper(model.get_submodule(part)), cache_size=4)
    assert _configs_of(model) == configs and _same(model, state)
    assert IMPLEMENTATION_NAME not in {module.config._experts_implementation for module in model.modules()
                                       if hasattr(module, "config")}  # fmt: skip
    model.save_pretrained(tmp_path)  # nothing served: the whole model saves
    enable_expert_cache(model, cache_size=4).disable()
