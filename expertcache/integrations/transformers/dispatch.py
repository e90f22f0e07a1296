"""The ``"expertcache"`` experts implementation registered with transformers.

``@use_experts_implementation`` makes an experts module's ``forward`` look up
``config._experts_implementation`` in transformers' experts-function registry. The cache
registers one more entry there; a served module's config names it, and each call becomes::

    hidden [T, H], top_k_index [T, K] (expert ids), top_k_weights [T, K]
      -> provider.passes(top_k_index)            misses copied into slots, ids -> slot ids
      -> SlotView(module): the module with its per-expert parameters replaced by the slot
         buffers ([S, ...]) and num_experts by S
      -> the implementation the module used before (eager, grouped_mm, batched_mm, ...),
         unchanged, on the SlotView with the slot ids; summed over the passes

so transformers' own expert computation runs on the slots: the cache is a weight provider,
not a second forward path. A call whose tokens need more distinct experts than there are
slots runs in expert-group passes (`expertcache.passes`): the strategy of the simulator and
the EP layer too, each expert copied at most once per call. transformers' implementations
do not skip -1 ids, so in each pass only the tokens with an id of that pass run (eagerly;
inside a CUDA graph every token runs), the other passes' ids pointed at one of this pass's
slots and weighted 0.
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
from expertcache.result import ExpertWeightResult
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
    total: torch.Tensor | None = None
    for result in binding.provider.passes(top_k_index):
        part = _run_pass(binding, self, hidden_states, result, top_k_weights)
        total = part if total is None else total + part
    assert total is not None  # a provider yields at least one pass
    return total


def _run_pass(
    binding: Binding,
    module: nn.Module,
    hidden_states: torch.Tensor,
    result: ExpertWeightResult,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The inner implementation on one pass's slots; ids of other passes contribute 0."""
    slots = {"w1": result.w1, "w2": result.w2, **result.extra}
    tensors = {binding.parameter_of[name]: tensor for name, tensor in slots.items()}
    view = SlotView(module, tensors, binding.provider.pool.num_slots)
    ids = result.topk_ids
    served = ids >= 0
    capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
    if torch.compiler.is_compiling() or capturing:
        # No sync: every token runs; a pass with no id at all is dropped by selection (its
        # filler slot may be free, full of NaN), never by multiplying.
        filler = ids.max().clamp(min=0)
        part = binding.inner(view, hidden_states, torch.where(served, ids, filler), top_k_weights * served)
        return torch.where(served.any(), part, torch.zeros_like(part))
    if bool(served.all()):
        return binding.inner(view, hidden_states, ids, top_k_weights)
    rows = served.any(dim=1).nonzero().squeeze(1)
    out = torch.zeros_like(hidden_states)
    if rows.numel():
        mine = ids[rows]
        filler = mine.max()  # some slot of this pass: loaded, finite
        mask = served[rows]
        part = binding.inner(view, hidden_states[rows], torch.where(mask, mine, filler), top_k_weights[rows] * mask)
        out = out.index_copy(0, rows, part.to(out.dtype))
    return out


def register() -> None:
    """Add the cache to transformers' experts registry (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, expertcache_experts_forward)
