"""Experts implementations by name: the name the cache is registered under, what a served
config copy's ``"expertcache"`` stands for, which implementation a served block should run
now, writing a config's choice, and the experts function a name resolves to for a module.

transformers reads ``config._experts_implementation`` and looks the name up in its experts
registry (`resolve`; ``"eager"``: the class's own forward, `original_forward`). A served
model's config copy names the cache and stands for the implementation the cache wraps
(`name_served`, `stands_for`); one chosen since with ``set_experts_implementation`` wins
(`chosen_implementation`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

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
