"""What `GraphedGenerator`'s decode step needs around it, each a function on its own.

* `check_model`: a transformers model, and a ``max_length`` its positions reach;
* `static_cache`: transformers' ``StaticCache`` for the step, with sliding-window layers that
  never slide turned static (their host-side length would freeze in a graph);
* `resolve_graphs` / `host_syncs`: whether the step can be captured (a host-mode expert cache,
  a routing recorder or transformers' ``eager`` experts loop reads the device on the host
  every layer);
* `decode_experts_implementation`: ``batched_mm`` where the model uses ``grouped_mm``, as
  ``model.generate`` decodes;
* `choose_tokens`: greedy or temperature / top-p sampling on the step's logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from expertcache.integrations.transformers import dispatch


def check_model(model: object, max_length: int) -> torch.device:
    """The device of ``model``'s input embeddings, once ``model`` is known to be a transformers
    causal LM (a module with ``get_input_embeddings``) whose positions reach ``max_length``.

    Raises:
        TypeError: ``model`` is not such a module (an `ExpertCacheHandle`: pass the model).
        ValueError: ``max_length`` above the model's ``max_position_embeddings`` (when its
            config states one).
    """
    if not isinstance(model, nn.Module) or not callable(getattr(model, "get_input_embeddings", None)):
        from expertcache.integrations.transformers.handle import ExpertCacheHandle

        hint = (
            ": pass the model itself (enable_expert_cache serves it in place; the handle is for stats and disable())"
            if isinstance(model, ExpertCacheHandle)
            else ""
        )
        raise TypeError(f"model must be a transformers causal LM (an nn.Module), got {type(model).__name__}{hint}")
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", None)  # a multimodal config keeps the text's apart
    limit = getattr(text_config() if callable(text_config) else config, "max_position_embeddings", None)
    if isinstance(limit, int) and max_length > limit:
        raise ValueError(
            f"max_length {max_length} is more than the model's max_position_embeddings ({limit}): "
            f"positions past it were never trained (lower max_length)"
        )
    causal_lm: Any = model
    return causal_lm.get_input_embeddings().weight.device


@contextlib.contextmanager
def decode_experts_implementation(model: Any, device: torch.device) -> Iterator[None]:
    """Decode with ``batched_mm`` where the model uses ``grouped_mm``, off the CPU, as
    ``model.generate`` does (its ``_optimize_model_for_decode``), so both compute the same
    tokens. Served blocks keep theirs: their config names ``"expertcache"``, for both."""
    previous = model.get_experts_implementation()
    switch = device.type != "cpu" and "grouped_mm" in previous.values()
    if switch:
        model.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in previous.items()})
    try:
        yield
    finally:
        if switch:
            model.set_experts_implementation(previous)


def choose_tokens(
    logits: torch.Tensor,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next tokens from ``[B, V]`` logits: the argmax (fp32, first of ties, as ``generate``),
    or a sample after temperature and nucleus (top-p) filtering. Returns ``[B]`` int64."""
    scores = logits.float()
    if not do_sample:
        return scores.argmax(dim=-1)
    scores = scores / temperature
    if top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # drop a token when the tokens ranked before it already hold top_p (the first always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        scores = scores.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)


def resolve_graphs(model: nn.Module, graphs: bool | str, device: torch.device) -> bool:
    """Whether to capture: ``"auto"`` means on CUDA when nothing in the step syncs the host.

    Raises:
        TypeError: ``graphs`` neither a bool nor a str (``1`` is not a promise).
        ValueError: ``graphs=True`` off CUDA, or with a host-mode expert cache or a routing
            recorder (both read ids on the host every layer); a str other than ``"auto"``.
    """
    if not isinstance(graphs, (bool, str)):
        raise TypeError(f"graphs must be True, False or 'auto', got {graphs!r:.40}")
    if isinstance(graphs, str) and graphs != "auto":
        raise ValueError(f"graphs must be True, False or 'auto', got {graphs!r}")
    syncs = host_syncs(model)
    if graphs == "auto":
        return device.type == "cuda" and not syncs
    if graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs need the model on a CUDA device; it is on {device} (use graphs=False)")
    if graphs and syncs:
        raise ValueError(f"{'; '.join(syncs)}: a CUDA graph cannot capture that (or use graphs=False)")
    return bool(graphs)


def host_syncs(model: nn.Module) -> list[str]:
    """What, in the expert cache serving ``model``, reads the device from the host every layer."""
    # dispatch keeps the one record of what serves a module; read it, don't mirror it
    bindings = [dispatch.binding_of(module) for module in model.modules()]
    served = [binding for binding in bindings if binding is not None]
    reasons = []
    if any(binding.provider.mode == "host" for binding in served):
        reasons.append(
            "a host-mode expert cache reads routing ids on the host every layer "
            "(enable_expert_cache(model, ..., mode='device') admits on the GPU)"
        )
    if any(binding.recorder is not None for binding in served):
        reasons.append("a RoutingRecorder copies every layer's routing ids to the host (enable the cache without one)")
    if any(_experts_implementation(module) == "eager" for module in model.modules()):
        reasons.append(
            "the 'eager' experts implementation finds the experts a layer hit with nonzero() on the host "
            "(model.set_experts_implementation('batched_mm') or 'grouped_mm' does not)"
        )
    return reasons


def _experts_implementation(module: nn.Module) -> str | None:
    """The experts implementation ``module`` runs: a served block's (the one the cache calls on
    its slots), an unserved ``@use_experts_implementation`` block's config's; None for any
    other module, or when the config names none (transformers' default)."""
    binding = dispatch.binding_of(module)
    if binding is not None:
        return dispatch.chosen_implementation(binding.config, binding.implementation)
    if getattr(type(module).forward, "__wrapped__", None) is None or not hasattr(module, "is_transposed"):
        return None  # not an experts block of transformers' registry
    config = getattr(module, "config", None)
    wrapped = dispatch.stands_for(config)  # a served model's config copy: what it stands for
    if wrapped is not None:
        return wrapped
    named = getattr(config, "_experts_implementation", None)
    return None if named is None else str(named)


def static_cache(model: Any, max_length: int, *, keep_sliding: bool = False):
    """A transformers ``StaticCache`` of ``max_length`` tokens for ``model`` (5.17 and later).

    Sliding-window layers whose window is at least ``max_length`` never slide, and become
    plain static layers: transformers' sliding layer keeps its length in a host int, which a
    captured graph would freeze. With a shorter window, graphs are refused (``keep_sliding``
    keeps the sliding layers for the eager path instead).

    Raises:
        ValueError: a window shorter than ``max_length`` without ``keep_sliding``.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=model.config, max_cache_len=max_length)
    layer: Any
    for index, layer in enumerate(cache.layers):
        if not getattr(layer, "is_sliding", False):
            continue
        window = int(layer.max_cache_len)  # min(sliding window, max_length)
        if window >= max_length:
            cache.layers[index] = StaticLayer(max_cache_len=max_length)
        elif not keep_sliding:
            raise ValueError(
                f"layer {index} attends over a sliding window of {window} tokens, fewer than "
                f"max_length {max_length}: its cache cannot be captured in a CUDA graph (lower max_length, "
                f"or graphs=False)"
            )
    return cache
