"""The ``"expertcache"`` experts implementation registered with transformers.

``@use_experts_implementation`` makes an experts module's ``forward`` look up
``config._experts_implementation`` in transformers' experts-function registry. The cache
registers one more entry there; a served module's config names it, and each call becomes::

    hidden [T, H], top_k_index [T, K] (expert ids), top_k_weights [T, K]
      -> provider.prepare(top_k_index)           misses copied into slots, ids -> slot ids
      -> SlotView(module): the module with its per-expert parameters replaced by the slot
         buffers ([S, ...]) and num_experts by S
      -> the implementation the module used before (eager, grouped_mm, batched_mm, ...),
         unchanged, on the SlotView with the slot ids

so transformers' own expert computation runs on the slots: the cache is a weight provider,
not a second forward path. A call whose tokens need more distinct experts than there are
slots runs as token pieces (`expertcache.chunking`).
"""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from expertcache.cached_provider import CachedWeightProvider
from expertcache.chunking import split_to_capacity
from expertcache.errors import CacheCapacityError
from expertcache.trace.recorder import RoutingRecorder

#: The name under which the cache is registered in transformers' experts registry.
IMPLEMENTATION_NAME = "expertcache"

ExpertsFunction = Callable[..., torch.Tensor]


@dataclass
class Binding:
    """What serves one experts module while the cache is on.

    Attributes:
        provider: the layer's cached weight provider.
        inner: the experts function the module used before (called on a `SlotView`).
        parameter_of: cache name (``w1``, ``w2``, extras) -> the module's parameter name.
        layer: model layer index (for the routing trace).
        recorder: where to record ``top_k_index``, or None.
    """

    provider: CachedWeightProvider
    inner: ExpertsFunction
    parameter_of: dict[str, str]
    layer: int
    recorder: RoutingRecorder | None = None


_BINDINGS: weakref.WeakKeyDictionary[nn.Module, Binding] = weakref.WeakKeyDictionary()


def bind(module: nn.Module, binding: Binding) -> None:
    """Serve ``module`` through ``binding`` (its config must name `IMPLEMENTATION_NAME`)."""
    if module in _BINDINGS:
        raise RuntimeError(f"{type(module).__name__} is already served by an expert cache")
    _BINDINGS[module] = binding


def unbind(module: nn.Module) -> None:
    _BINDINGS.pop(module, None)


def is_bound(module: nn.Module) -> bool:
    return module in _BINDINGS


class SlotView:
    """Stands in for an experts module during one call, reading the slot buffers.

    Attribute lookups fall through to the module, except the per-expert parameters (the
    slot buffers ``[S, ...]``) and ``num_experts`` (``S``). Methods defined on the module's
    class are bound to the view, so helpers that read weights through ``self`` read slots.
    """

    __slots__ = ("_module", "_tensors")

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor], num_slots: int) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_tensors", {**tensors, "num_experts": num_slots})

    def __getattr__(self, name: str):
        tensors = object.__getattribute__(self, "_tensors")
        if name in tensors:
            return tensors[name]
        module = object.__getattribute__(self, "_module")
        attribute = inspect.getattr_static(type(module), name, None)
        if isinstance(attribute, types.FunctionType):
            return types.MethodType(attribute, self)
        return getattr(module, name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"SlotView is read-only (tried to set {name!r})")


def expertcache_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The registered experts function (same signature as transformers' own).

    Args:
        hidden_states: ``[T, H]`` tokens.
        top_k_index: ``[T, K]`` int64 global expert ids from the router.
        top_k_weights: ``[T, K]`` router weights.

    Returns:
        ``[T, H]``, what the module's previous implementation returns on the full weights.
    """
    binding = _BINDINGS.get(self)
    if binding is None:
        raise RuntimeError(
            f"{type(self).__name__}'s config selects the {IMPLEMENTATION_NAME!r} experts "
            f"implementation, but no expert cache serves this module: call "
            f"expertcache.integrations.transformers.enable_expert_cache(model, ...)"
        )
    if binding.recorder is not None:
        binding.recorder.record(binding.layer, top_k_index)
    try:
        return _run(binding, self, hidden_states, top_k_index, top_k_weights)
    except CacheCapacityError:
        # More distinct experts than slots (a prefill): the cache is unchanged; run the
        # tokens in pieces that fit. Each token's output depends only on its own row.
        ids = top_k_index.reshape(-1, top_k_index.shape[-1])
        pieces = split_to_capacity(ids.cpu().numpy(), binding.provider.pool.num_slots)
        outputs = [_run(binding, self, hidden_states[piece], ids[piece], top_k_weights[piece]) for piece in pieces]
        return torch.cat(outputs)


def _run(
    binding: Binding,
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    result = binding.provider.prepare(top_k_index)
    slots = {"w1": result.w1, "w2": result.w2, **result.extra}
    tensors = {binding.parameter_of[name]: tensor for name, tensor in slots.items()}
    view = SlotView(module, tensors, binding.provider.pool.num_slots)
    return binding.inner(view, hidden_states, result.topk_ids, top_k_weights)


def register() -> None:
    """Add the cache to transformers' experts registry (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, expertcache_experts_forward)
