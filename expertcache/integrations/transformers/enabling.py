"""`enable_expert_cache`: serve every routed-expert block of a transformers model from the cache.

For each expert block (found by `discovery`), its per-expert parameters are copied into a
`CachedWeightProvider` (pinned host store + GPU slots) and the parameters themselves shrink
to empty placeholders, so the GPU keeps only the slots; shared experts, routers, attention
and everything else stay where they were. The block's config then selects the
``"expertcache"`` experts implementation (`dispatch`): the model's own copy of it
(`model_configs`), so other models built from the same config object keep theirs. The
returned `ExpertCacheHandle` reports statistics and ``disable()`` puts the original weights
(and config objects) back, all or nothing.

This module holds the enabling: `enable_expert_cache`, with every check it makes before it
changes anything, and `check_cache_size`, which a command line runs on a meta-device model
before loading a checkpoint. The handle is `handle.ExpertCacheHandle`; `handle` re-exports
both functions, under the import path they always had.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedConfig

from expertcache.config import ExpertCacheConfig, cache_size_range, config_top_k
from expertcache.integrations.transformers import dispatch
from expertcache.integrations.transformers.discovery import (
    ExpertBlock,
    UnsupportedModelError,
    experts_interface_of,
    find_expert_blocks,
    model_family,
)
from expertcache.integrations.transformers.model_configs import ModelConfigs
from expertcache.integrations.transformers.model_guards import guard_model
from expertcache.integrations.transformers.model_parts import enclosing_model
from expertcache.integrations.transformers.serving import (
    ServedBlock,
    block_layout,
    check_pin_budget,
    serve_blocks,
    shared_pool,
)
from expertcache.trace.recorder import RoutingRecorder
from expertcache.validation import resolve_device

if TYPE_CHECKING:
    from expertcache.integrations.transformers.handle import ExpertCacheHandle

_UNSET = object()


def enable_expert_cache(
    model: nn.Module,
    config: ExpertCacheConfig | None = _UNSET,  # type: ignore[assignment]
    *,
    cache_size: int | None = None,
    policy: str | None = None,
    budget: str | None = None,
    device: str | torch.device | None = None,
    pin_budget_bytes: int | None = None,
    recorder: RoutingRecorder | None = None,
    mode: str | None = None,
    compression: str | None = None,
) -> ExpertCacheHandle | None:
    """Serve every routed-expert block of a transformers (5.x) model through the cache.

    Args:
        model: a transformers model (e.g. ``AutoModelForCausalLM``) with its weights loaded.
        config: an `ExpertCacheConfig` (from `expertcache.cli.cache_config_from_args`) instead
            of the keyword settings (giving both raises TypeError). ``None``, what that
            function returns when the engine's flags leave the cache off, changes nothing
            and returns None (with any keyword besides, which would be ignored: TypeError).
        cache_size: GPU slots per MoE layer, between the router's top-k and the number of
            experts per layer (with ``budget="global"``: one pool of cache_size x layers).
        policy: eviction policy name (default ``"lru"``).
        budget: ``"per-layer"`` or ``"global"`` (default: `expertcache.config.DEFAULT_BUDGET`).
        device: where the slots live (default: where the expert weights are now; the
            command line's ``--moe-expert-cache-device`` defaults to the GPU when there is one).
        pin_budget_bytes: refuse, before pinning anything, to pin more host memory in all.
        recorder: a `RoutingRecorder` that receives every MoE layer's ``topk_ids`` (one
            recorder records one model: not one that another served model feeds).
        mode: ``"host"`` (default) or ``"device"`` (GPU admission, LRU, CUDA-graph capturable).
        compression: ``"exponent"``: store bf16/fp16 experts losslessly exponent-coded in
            pinned memory (~0.68 of the bytes over PCIe, slots bit-identical); default None.
            The pin budget is checked against the raw bytes (an upper bound).

    Returns:
        An `ExpertCacheHandle` (``stats``, ``disable()``, ``config``); None for ``config=None``.

    Raises:
        TypeError: ``model`` is not a module; ``recorder`` is not a `RoutingRecorder`; config
            and keyword settings both given.
        UnsupportedModelError: the model's experts cannot be served (names the family).
        NoExpertsError: the model has no MoE layers.
        ValueError: a setting out of range for this model (a ``device`` that does not exist
            here); a recorder set up for other layers or experts, or already recording
            another served model; ``model`` is a part of a larger model sharing its config
            (``model.model``: enable the cache on ``model``); PinBudgetError: over the budget.
        Nothing is changed when any of these is raised (the recorder included).
    """
    from expertcache.integrations.transformers.handle import ExpertCacheHandle  # it imports this module

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    if recorder is not None and not isinstance(recorder, RoutingRecorder):
        raise TypeError(f"recorder must be an expertcache.trace.RoutingRecorder or None, got {type(recorder).__name__}")
    settings: dict[str, object] = {
        "cache_size": cache_size,
        "policy": policy,
        "budget": budget,
        "device": device,
        "pin_budget_bytes": pin_budget_bytes,
        "mode": mode,
        "compression": compression,
    }
    if config is None:
        given = [name for name, value in {**settings, "recorder": recorder}.items() if value is not None]
        if given:
            raise TypeError(f"config=None turns the cache off, so {', '.join(given)} would be ignored; drop them")
        return None
    config = _resolve_config(config, settings)
    if any(dispatch.is_bound(module) for module in model.modules()):
        raise RuntimeError("the expert cache is already enabled on this model; disable() it first")
    _check_whole(model)
    blocks = check_cache_size(model, config.cache_size)
    _check_not_meta(model, blocks)
    target = resolve_device(config.device or blocks[0].module.get_parameter("gate_up_proj").device)
    inner = {block.name: _previous_implementation(model, block) for block in blocks}
    description = _check_recorder(recorder, model, blocks)
    layouts = [block_layout(block) for block in blocks]
    check_pin_budget(blocks, layouts, config.pin_budget_bytes)
    pool = shared_pool(blocks, layouts, config, target) if config.budget == "global" else None
    expert_bytes = sum(block.module.get_parameter(name).nbytes for block in blocks for name in block.parameter_names)
    configs = ModelConfigs(model)  # copies only: the model still holds its own objects
    served = serve_blocks(blocks, config, target, pool)
    if recorder is not None:
        recorder.describe(**description)  # checked on a copy above: cannot fail
    configs.install()  # the names below go on this model's copies, not on a shared config
    for item in served:
        block_config = getattr(item.block.module, "config")  # noqa: B009 - set by the decorator
        name, function = inner[item.block.name]
        dispatch.bind(item.block.module, _binding(item, function, recorder, block_config, name))
        dispatch.name_served(block_config, name)
    return ExpertCacheHandle(config, served, recorder, expert_bytes, configs, guard_model(model, blocks))


def check_cache_size(model: nn.Module, cache_size: int) -> list[ExpertBlock]:
    """Find the model's expert blocks and check ``cache_size`` against them.

    Works on a model built on the meta device too (no weights needed), so a command line can
    reject a bad size before loading a checkpoint.

    Returns:
        The expert blocks.

    Raises:
        UnsupportedModelError / NoExpertsError: see `find_expert_blocks`.
        ValueError: ``cache_size`` outside ``[top-k, experts per layer]``; a config whose
            ``num_experts_per_tok`` is no top-k (`expertcache.config.config_top_k`).
    """
    blocks = find_expert_blocks(model)
    fewest = min(block.num_experts for block in blocks)
    top_k = max(config_top_k(block.module.config, block.num_experts) for block in blocks)
    if cache_size not in cache_size_range(top_k, fewest):
        raise ValueError(
            f"the expert cache size (--moe-expert-cache-size, slots per MoE layer) must be between "
            f"{top_k} (the router's top-k) and {fewest} (experts per layer) for this "
            f"{model_family(model)} model, got {cache_size}"
        )
    return blocks


def _resolve_config(config: object, settings: dict[str, object]) -> ExpertCacheConfig:
    given = [name for name, value in settings.items() if value is not None]
    if config is not _UNSET:
        if not isinstance(config, ExpertCacheConfig):
            raise TypeError(f"config must be an ExpertCacheConfig or None, got {type(config).__name__}")
        if given:
            raise TypeError(
                f"give either config or the keyword settings, not both: {', '.join(given)} beside a config "
                "would be ignored (use dataclasses.replace(config, ...) to change a setting)"
            )
        return config
    if settings["cache_size"] is None:
        raise TypeError("enable_expert_cache needs cache_size (GPU slots per MoE layer) or a config")
    chosen = {name: value for name, value in settings.items() if value is not None}
    if "device" in chosen:
        chosen["device"] = str(chosen["device"])
    config = ExpertCacheConfig(**chosen)  # type: ignore[arg-type]
    if settings["device"] is not None:
        # the config spells every CPU "cpu": check the device as given ("cpu:1" does not exist)
        try:
            resolve_device(settings["device"])  # type: ignore[arg-type]
        except ValueError as error:
            raise ValueError(f"device {str(settings['device'])!r}: {error}") from None
    return config


def _check_recorder(recorder: RoutingRecorder | None, model: nn.Module, blocks: list[ExpertBlock]) -> dict[str, Any]:
    """What ``recorder.describe`` will be told about ``model``, checked without changing the
    recorder (on a copy): set up for the same layers and experts, and no other served model
    recording into it (one trace describes one model)."""
    description: dict[str, Any] = {
        "layers": [block.layer for block in blocks],
        "num_experts": max(block.num_experts for block in blocks),
        "model": model_family(model),
    }
    if recorder is None:
        return description
    if dispatch.recorder_in_use(recorder):
        raise ValueError(
            f"this RoutingRecorder already records another served model ({recorder.model or 'unnamed'}): one "
            f"recorder's trace describes one model. Give this {description['model']} model its own RoutingRecorder, "
            f"or disable() the other model's cache first"
        )
    copy.copy(recorder).describe(**description)  # refuses other layers or experts; the recorder is untouched
    return description


def _check_whole(model: nn.Module) -> None:
    outer = enclosing_model(model)
    if outer is not None:
        name = type(outer).__name__
        what = "is part of" if isinstance(getattr(model, "config", None), PreTrainedConfig) else "holds a part of"
        raise ValueError(
            f"{type(model).__name__} {what} a {name} that shares its config (transformers builds a model's "
            f"inner models on its config object): serving only the part would leave the {name}'s config, "
            f"set_experts_implementation, save_pretrained and load_state_dict unaware of the cache. Call "
            f"enable_expert_cache on the {name} instead (it serves the same expert blocks); nothing was changed"
        )


def _check_not_meta(model: nn.Module, blocks: list[ExpertBlock]) -> None:
    for block in blocks:
        if any(block.module.get_parameter(name).is_meta for name in block.parameter_names):
            raise ValueError(
                f"{block.name} of this {model_family(model)} model has its weights on the meta "
                f"device: load the weights (from_pretrained) before enabling the expert cache"
            )


def _previous_implementation(model: nn.Module, block: ExpertBlock) -> tuple[str, dispatch.ExpertsFunction]:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    interface = experts_interface_of(block.module) or ALL_EXPERTS_FUNCTIONS
    if not dispatch.register(interface):
        reason = "dispatches through an experts registry that the cache is not registered in"
        raise UnsupportedModelError(model_family(model), [(block.name, type(block.module).__name__, reason)])
    config = getattr(block.module, "config")  # noqa: B009 - set by the decorator
    previous = str(config._experts_implementation or "eager")
    if previous == dispatch.IMPLEMENTATION_NAME:
        wrapped = dispatch.stands_for(config)  # a served model's config copy: what it stands for
        if wrapped is None:
            raise RuntimeError(
                f"{block.name} selects the {previous!r} experts implementation, which no expert cache serves: "
                f"select the implementation the cache should wrap (model.set_experts_implementation('grouped_mm'), "
                f"'batched_mm', 'eager', ...), then enable the cache"
            )
        previous = wrapped
    try:
        return previous, dispatch.resolve(block.module, previous)
    except KeyError as error:  # a name transformers' setter took for another class's registry
        raise ValueError(f"{block.name}: {error.args[0]}") from None


def _binding(item: ServedBlock, inner, recorder, config: object, implementation: str) -> dispatch.Binding:
    block = item.block
    parameter_of = {block.cache_name(name): name for name in block.parameter_names}
    return dispatch.Binding(
        item.provider, inner, parameter_of, block.layer, recorder,
        config=config, implementation=implementation, placeholders=dict(item.saved),
    )  # fmt: skip
