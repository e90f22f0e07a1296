"""What serves each experts module while the cache is on: its `Binding`, the registry of
them (`bind`, `unbind`, lookups), and the forward pre-hook `bind` attaches.

The pre-hook keeps two promises at every call: an implementation chosen with
``model.set_experts_implementation(...)`` while served is followed (the cache keeps
serving, now wrapping that one; ``disable()`` leaves it selected), and a change of a served
parameter that the cached experts do not follow is refused with an error saying what to
do: a dtype change of the model (``model.to(torch.bfloat16)``), or new weights put in
without ``load_state_dict`` (which `model_guards` refuses at the call), e.g.
``param.data = w`` (`check_placeholders`). `bind` also attaches a `SaveGuard`, which
refuses ``state_dict()``, ``copy.deepcopy`` and pickling of a served module (`save_guard`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from torch import nn

from expertcache.cached_provider import CachedWeightProvider
from expertcache.integrations.transformers.implementations import (
    ExpertsFunction,
    chosen_implementation,
    name_served,
    resolve,
    stands_for,
)
from expertcache.integrations.transformers.save_guard import SaveGuard
from expertcache.integrations.transformers.serving import SavedParameter, current_placeholder
from expertcache.trace.recorder import RoutingRecorder


@dataclass
class Binding:
    """What serves one experts module while the cache is on.

    Attributes:
        provider: the layer's cached weight provider.
        inner: the experts function the module used before (called on a `SlotView`).
        parameter_of: cache name (``w1``, ``w2``, extras) -> the module's parameter name.
        layer: model layer index (for the routing trace).
        recorder: where to record ``top_k_index``, or None.
        config: the block's config (the served model's copy), where the choice of
            implementation is read and written (None: ``inner`` is fixed).
        implementation: the registry name ``inner`` was resolved from.
        placeholders: parameter name -> the module's `SavedParameter` (the Parameter object
            that holds an empty placeholder while served, and the cached experts' dtype),
            checked at every call (`check_placeholders`).
        hook: the handle of the module's forward pre-hook (removed by `unbind`).
        guard: the handle of its `save_guard.SaveGuard` (removed by `unbind`).
    """

    provider: CachedWeightProvider
    inner: ExpertsFunction
    parameter_of: dict[str, str]
    layer: int
    recorder: RoutingRecorder | None = None
    config: object = None
    implementation: str = "eager"
    placeholders: dict[str, SavedParameter] = field(default_factory=dict)
    hook: object = None
    guard: object = None


_BINDINGS: weakref.WeakKeyDictionary[nn.Module, Binding] = weakref.WeakKeyDictionary()


def bind(module: nn.Module, binding: Binding) -> None:
    """Serve ``module`` through ``binding`` (its config must name `IMPLEMENTATION_NAME`)."""
    if module in _BINDINGS:
        raise RuntimeError(f"{type(module).__name__} is already served by an expert cache")
    _BINDINGS[module] = binding
    binding.hook = module.register_forward_pre_hook(_before_forward)
    binding.guard = module.register_state_dict_pre_hook(SaveGuard(type(module).__name__))


def unbind(module: nn.Module) -> None:
    binding = _BINDINGS.pop(module, None)
    if binding is None:
        return
    for hook in (binding.hook, binding.guard):
        if hook is not None:
            hook.remove()  # type: ignore[attr-defined]


def is_bound(module: nn.Module) -> bool:
    return module in _BINDINGS


def recorder_in_use(recorder: RoutingRecorder) -> bool:
    """Whether a served module (of any model) records its routing into ``recorder``."""
    return any(binding.recorder is recorder for binding in list(_BINDINGS.values()))


def binding_of(module: nn.Module) -> Binding | None:
    """What serves ``module`` (its provider, recorder, ...), or None when the cache does not."""
    return _BINDINGS.get(module)


def _before_forward(module: nn.Module, args: tuple) -> None:
    binding = _BINDINGS.get(module)
    if binding is None:
        return
    check_placeholders(module, binding.placeholders)  # first: a refusal changes nothing
    config = binding.config
    if config is not None:
        name = chosen_implementation(config, binding.implementation)
        if name != binding.implementation:
            binding.inner = resolve(module, name)  # a bad name raises before anything changes
            binding.implementation = name
        if stands_for(config) != name:
            name_served(config, name)


def served_parameter_ids() -> set[int]:
    """``id`` of every served parameter's placeholder, in every served model."""
    return {id(saved.parameter) for binding in list(_BINDINGS.values()) for saved in binding.placeholders.values()}


def check_placeholders(module: nn.Module, placeholders: dict[str, SavedParameter]) -> None:
    """Raise RuntimeError when a served parameter was changed behind the cache's back.

    The cache serves the experts it took at enabling; the module keeps an empty placeholder
    in the same Parameter object. A load that bypasses ``load_state_dict`` (``param.data =
    w``, assigning a new Parameter, accelerate's ``set_module_tensor_to_device``) would
    otherwise be ignored without a word, a tie to another served parameter would serve one
    layer's experts as another's, and a cast (``model.to(torch.bfloat16)``) would mix dtypes.
    Every call checks, before anything is copied, that each parameter is its placeholder
    (`serving.current_placeholder`: the same object, or a new empty one a conversion put in
    its place, which then stands for the experts and which ``disable()`` fills), empty, in
    the cached dtype. A refusal changes nothing.
    """
    adopted: list[tuple[SavedParameter, nn.Parameter]] = []
    for parameter_name, saved in placeholders.items():
        now = saved.parameter if module._parameters.get(parameter_name) is saved.parameter else None
        if now is None:  # a conversion's new empty placeholder, or None
            now = current_placeholder(module, parameter_name, saved, served_parameter_ids())
        where = f"{type(module).__name__}.{parameter_name}"
        if parameter_name not in module._parameters and not hasattr(module, parameter_name):
            raise RuntimeError(
                f"{where} was deleted (del, delattr) after the expert cache was enabled, but the cache serves it: "
                f"register a Parameter there again (the one deleted, or an empty one of its dtype, which disable() "
                f"fills); nothing was computed"
            )
        if now is None or now.numel() != 0:
            raise RuntimeError(
                f"{where} was replaced, refilled or tied (param.data = ..., a new Parameter, "
                f"set_module_tensor_to_device, another served parameter) after the expert cache was enabled, but "
                f"the cache serves the experts it took then: the new weights would be ignored. Call disable() on "
                f"the ExpertCacheHandle, set the weights, then enable_expert_cache again; nothing was computed"
            )
        if now.dtype != saved.dtype:
            raise RuntimeError(
                f"{where} was cast from {saved.dtype} to {now.dtype} (model.to, .half(), .bfloat16()) after the "
                f"expert cache was enabled, but the cache holds the experts in {saved.dtype}: the outputs would "
                f"differ. Call disable() on the ExpertCacheHandle (it puts the experts back in {now.dtype}), then "
                f"enable_expert_cache again"
            )
        if now is not saved.parameter:
            adopted.append((saved, now))
    for saved, now in adopted:  # every check passed: the new placeholders stand for the experts
        saved.parameter = now
