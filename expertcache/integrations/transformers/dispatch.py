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

A forward pre-hook on each served module (`bindings`) follows an implementation chosen with
``model.set_experts_implementation(...)`` while served and refuses a change of a served
parameter that the cached experts do not follow (`check_placeholders`); a `SaveGuard`
refuses ``state_dict()``, ``copy.deepcopy`` and pickling of a served module (`save_guard`).

This module owns the registered experts function and its registration in transformers'
registries. The implementation names (what a config names, what the cache's name stands
for, what a name resolves to) are in `implementations`; the bindings, their registry and
the pre-hook that checks each call, in `bindings` (all importable from here too).
"""

from __future__ import annotations

import torch
from torch import nn

from expertcache.integrations.transformers.bindings import (
    Binding,
    bind,
    binding_of,
    check_placeholders,
    is_bound,
    recorder_in_use,
    served_parameter_ids,
    unbind,
)
from expertcache.integrations.transformers.implementations import (
    IMPLEMENTATION_NAME,
    ExpertsFunction,
    chosen_implementation,
    name_served,
    original_forward,
    resolve,
    set_config_implementation,
    stands_for,
)
from expertcache.integrations.transformers.inference_only import without_backward
from expertcache.integrations.transformers.pass_runs import run_call

__all__ = [
    "IMPLEMENTATION_NAME",
    "Binding",
    "ExpertsFunction",
    "bind",
    "binding_of",
    "check_placeholders",
    "chosen_implementation",
    "expertcache_experts_forward",
    "is_bound",
    "name_served",
    "original_forward",
    "recorder_in_use",
    "register",
    "resolve",
    "served_parameter_ids",
    "set_config_implementation",
    "stands_for",
    "unbind",
]


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
    binding = binding_of(self)
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
