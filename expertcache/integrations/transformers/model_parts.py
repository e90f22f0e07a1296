"""Whether a module given to `enable_expert_cache` is a part of a larger model sharing its config.

transformers builds a model's inner models on the config object it was given
(``Qwen3MoeForCausalLM(config).model`` holds that very ``config``; a multimodal model's text
tower holds its ``config.text_config``). Serving only the inner model gave it a copy of the
config (`model_configs`) while the outer model kept the original, so the outer model's
``set_experts_implementation``, ``model.config`` changes, ``save_pretrained`` and
``load_state_dict`` did not see the cache. Enabling on such a part is refused, naming the
model to enable it on, and so is enabling on a module that wraps a part
(``Wrapper(causal_lm.model)``, holding no config of its own: it served the part the same
way). A module wrapping a whole model is served like the model; a model of its own that
merely shares a config object with another model (``AutoModel.from_config(config)`` beside
a causal LM of the same config) is not a part.

A module keeps no link to the modules holding it, so the outer model is found through the
garbage collector's referrer lists: modules outside the part that hold one of its config
objects (or a config holding one, for a tower's sub-config) and contain the part (or the
part a wrapper holds). In the common case (nothing outside the part holds its configs) that
is one scan of the objects the collector tracks, a small cost beside copying the experts.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

from torch import nn
from transformers import PreTrainedConfig


def enclosing_model(model: nn.Module) -> nn.Module | None:
    """The outermost module outside ``model`` that holds one of its config objects (or a
    config holding one) and contains a module of ``model`` holding a config: ``model``
    itself (a part), or a part that ``model`` wraps (``Wrapper(causal_lm.model)``, which
    holds no config of its own). None when ``model`` is no part and wraps none."""
    modules = list(model.modules())
    inside = {id(module) for module in modules} | {id(vars(module)) for module in modules}
    built_on = [module for module in modules if isinstance(getattr(module, "config", None), PreTrainedConfig)]
    parts = {id(module) for module in built_on}
    configs: list[PreTrainedConfig] = [getattr(module, "config") for module in built_on]  # noqa: B009 - nn.Module types it as a Tensor
    seen = {id(config) for config in configs}
    enclosing: list[nn.Module] = []
    while configs:
        holders = _holders(configs, skip=inside)
        configs = [holder for holder in holders if isinstance(holder, PreTrainedConfig) and id(holder) not in seen]
        seen.update(id(config) for config in configs)
        enclosing.extend(
            holder
            for holder in holders
            if isinstance(holder, nn.Module) and any(id(module) in parts for module in holder.modules())
        )
    return max(enclosing, key=lambda holder: sum(1 for _ in holder.modules()), default=None)


def _holders(objects: Sequence[object], *, skip: set[int]) -> list[nn.Module | PreTrainedConfig]:
    """The modules and configs whose attributes hold one of ``objects`` (none in ``skip``).

    An object's attributes reach the collector either as its ``__dict__`` (a dict refers to
    the object held; a second scan finds the dict's owner) or inline in the object itself.
    """
    found: list[nn.Module | PreTrainedConfig] = []
    dicts: dict[int, dict] = {}
    for referrer in gc.get_referrers(*objects):
        if id(referrer) in skip:
            continue
        if isinstance(referrer, dict):
            dicts[id(referrer)] = referrer
        elif isinstance(referrer, (nn.Module, PreTrainedConfig)):
            found.append(referrer)
    if dicts:
        for owner in gc.get_referrers(*dicts.values()):
            if isinstance(owner, (nn.Module, PreTrainedConfig)) and id(vars(owner)) in dicts and id(owner) not in skip:
                found.append(owner)
    return found
