"""The ``"expertcache"`` experts implementation registered with transformers.

``@use_experts_implementation`` makes an experts module's ``forward`` look up
``config._experts_implementation`` in transformers' experts-function registry. The cache
registers one more entry there; a served module's config names it (the served model's own
copy of its config, `model_configs`: other models built from the same config object keep
their implementation), standing for the implementation the cache wraps (`name_served`),
and each call becomes::

    hidden [T, H], top_k_index [T, K] (expert ids), top_k_weights [T, K]
      -> provider.passes(top_k_index)            misses copied into slots, ids -> slot ids
      -> SlotView(module): the module with its per-expert parameters replaced by slot
         tensors ([N, ...]) and num_experts by N (`slot_view`)
      -> the implementation the module used before (eager, grouped_mm, batched_mm, ...),
         unchanged, on the SlotView with the slot ids; the passes made one (`pass_runs`)

so transformers' own expert computation runs on the slots: the cache is a weight provider,
not a second forward path. A call whose tokens need more distinct experts than there are
slots runs in expert-group passes (`expertcache.passes`): the strategy of the simulator and
the EP layer too, each expert copied at most once per call; `pass_runs` turns the passes
into one output (bit-identical to the uncached call for ``batched_mm`` and the project's
kernels) and `slot_view` says what an implementation sees. An experts function may carry
``check(view)``: called on a `SlotView` of the whole pool before anything is copied, so
what it refuses (raising) leaves the cache as it was.

A model built from a served model's ``model.config`` holds that copy, unserved: its modules
run the implementation the copy stands for, on their own experts, for as long as the copy
lives (whatever became of the served model: dropped without ``disable()`` too). A deep copy
or a pickle of such a model holds a new config object that names the cache without saying
which implementation: its forward says to choose one (``set_experts_implementation``).

A forward pre-hook on each served module keeps two promises at every call: an
implementation chosen with ``model.set_experts_implementation(...)`` while served is
followed (the cache keeps serving, now wrapping that one; ``disable()`` leaves it
selected), and a change of a served parameter that the cached experts do not follow is
refused with an error saying what to do: a dtype change of the model
(``model.to(torch.bfloat16)``), or new weights put in without ``load_state_dict`` (which
`model_guards` refuses at the call), e.g. ``param.data = w`` (`check_placeholders`). A `SaveGuard`
refuses ``state_dict()``, ``copy.deepcopy`` and pickling of a served module (`save_guard`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from expertcache.cached_provider import CachedWeightProvider
from expertcache.integrations.transformers.inference_only import without_backward
from expertcache.integrations.transformers.pass_runs import run_call
from expertcache.integrations.transformers.save_guard import SaveGuard
from expertcache.integrations.transformers.serving import SavedParameter, current_placeholder
from expertcache.trace.recorder import RoutingRecorder

#: The name under which the cache is registered in transformers' experts registry.
IMPLEMENTATION_NAME = "expertcache"

ExpertsFunction = Callable[..., torch.Tensor]

#: id(config) -> the implementation a served config copy's ``"expertcache"`` stands for. An
#: entry lives as long as its config object (a finalizer drops it), so a model built from
#: the copy runs it whatever became of the served model. A plain ``str`` on the config itself
#: would be the cleaner home, but transformers dispatches on the config's name inside
#: compiled code, where a ``str`` subclass is no constant, and saves any other attribute.
_STANDS_FOR: dict[int, str] = {}


def name_served(config: object, wraps: str) -> None:
    """Make ``config`` name the cache, standing for ``wraps`` (the implementation the cache
    runs on the slots, and any other model holding ``config`` runs on its own experts)."""
    key = id(config)
    if key not in _STANDS_FOR:
        weakref.finalize(config, _STANDS_FOR.pop, key, None)
    _STANDS_FOR[key] = str(wraps)
    set_config_implementation(config, IMPLEMENTATION_NAME)


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


def resolve(module: nn.Module, name: str) -> ExpertsFunction:
    """The experts function registered as ``name`` for ``module``'s class (``"eager"``: its
    own forward). Raises KeyError for a name the registry does not hold."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from expertcache.integrations.transformers.discovery import experts_interface_of

    interface = experts_interface_of(module) or ALL_EXPERTS_FUNCTIONS
    try:
        return interface.get_interface(str(name), original_forward(module))
    except KeyError:
        raise KeyError(
            f"experts implementation {name!r} is not registered for {type(module).__name__} "
            f"(its registry holds {', '.join(sorted({'eager', *map(str, interface)}))})"  # eager: its own forward
        ) from None


def original_forward(module: nn.Module) -> ExpertsFunction:
    """The class's own forward under ``@use_experts_implementation`` (its ``"eager"``).

    transformers applies the decorator again each time it builds a quantized experts class
    (``replace_with_fp8_linear`` wraps ``FP8Experts`` once per expert block), so the wrappers
    nest: unwrap every one of them, or ``"eager"`` would dispatch on the config again.
    """
    dispatcher = type(module).forward
    forward = getattr(dispatcher, "__wrapped__")  # noqa: B009 - set by the decorator
    while getattr(forward, "__code__", None) is dispatcher.__code__:
        forward = forward.__wrapped__
    return forward


def stands_for(config: object) -> str | None:
    """The implementation a config naming the cache stands for (`name_served`), or None when
    ``config`` names another, or was never named so (a deep copy of a served config)."""
    if getattr(config, "_experts_implementation", None) != IMPLEMENTATION_NAME:
        return None
    return _STANDS_FOR.get(id(config))


def chosen_implementation(config: object, current: str) -> str:
    """The implementation the served blocks of ``config`` should run now: a name the config was
    given since (``set_experts_implementation``), else the one it stands for (`name_served`),
    else ``current`` (the config names the cache without saying which: keep what runs)."""
    named = getattr(config, "_experts_implementation", None)
    if named == IMPLEMENTATION_NAME:
        return stands_for(config) or current
    return str(named) if named else current


def set_config_implementation(config: object, name: object) -> None:
    """Write ``config``'s experts implementation (the internal field, not the property: the
    property's setter also rewrites sub-configs)."""
    if hasattr(config, "_experts_implementation_internal"):
        config._experts_implementation_internal = name  # type: ignore[attr-defined]
    else:
        config._experts_implementation = name  # type: ignore[attr-defined]


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


@torch.compiler.disable
def expertcache_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The registered experts function (same signature as transformers' own).

    Kept out of torch.compile (``torch.compiler.disable``): a compiled model runs it eagerly
    between its compiled pieces (``fullgraph=True`` refuses, naming it). Traced, the slot
    views and the passes' host-side choices were not followed (wrong outputs, no error).
    Inference only: a forward with gradients enabled runs, a backward through it raises
    (`inference_only`).

    Args:
        hidden_states: ``[T, H]`` tokens.
        top_k_index: ``[T, K]`` int64 global expert ids from the router.
        top_k_weights: ``[T, K]`` router weights.

    Returns:
        ``[T, H]``, what the module's previous implementation returns on the full weights.
    """
    binding = _BINDINGS.get(self)
    if binding is None:
        wrapped = stands_for(getattr(self, "config", None))
        if wrapped is not None:  # a model holding a served model's config copy: not served
            return resolve(self, wrapped)(self, hidden_states, top_k_index, top_k_weights)
        raise RuntimeError(
            f"{type(self).__name__}'s config selects the {IMPLEMENTATION_NAME!r} experts implementation, but no "
            f"expert cache serves this module (a copy of a model built from a served model's config?): choose "
            f"the implementation to run, model.set_experts_implementation('eager' | 'grouped_mm' | 'batched_mm' "
            f"| ...), then enable_expert_cache(model, ...) if it should be served"
        )
    if binding.recorder is not None:
        binding.recorder.record(binding.layer, top_k_index)
    return without_backward(
        lambda: run_call(binding, self, hidden_states, top_k_index, top_k_weights),
        f"layer {binding.layer}'s {type(self).__name__}",
        hidden_states,
        top_k_weights,
        (getattr(self, name) for name in binding.parameter_of.values()),
    )


def register(interface: object | None = None) -> bool:
    """Add the cache to transformers' experts registries (idempotent).

    Always to ``ALL_EXPERTS_FUNCTIONS`` and, where this transformers has it, the FP8
    registry ``ALL_FP8_EXPERTS_FUNCTIONS`` that ``FP8Experts`` dispatches through (5.17 and
    5.24); with ``interface``, also to that registry (any ``ExpertsInterface`` a decorated
    class was given, e.g. `quantized.MXFP4_EXPERTS_FUNCTIONS`).

    Returns:
        Whether the cache is registered in ``interface`` (True without one).
    """
    from transformers.integrations.moe import ExpertsInterface

    from expertcache.integrations.transformers import quantized

    ExpertsInterface.register(IMPLEMENTATION_NAME, expertcache_experts_forward)
    quantized.register()
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers without FP8 experts
        pass
    else:
        FP8ExpertsInterface.register(IMPLEMENTATION_NAME, expertcache_experts_forward)
    if interface is None:
        return True
    if isinstance(interface, ExpertsInterface) and IMPLEMENTATION_NAME not in interface:
        type(interface).register(IMPLEMENTATION_NAME, expertcache_experts_forward)
    return IMPLEMENTATION_NAME in interface  # type: ignore[operator]
