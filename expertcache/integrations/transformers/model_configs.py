"""A served model's own config objects: the cache's selection is recorded there, per model.

transformers dispatches an experts module through ``module.config._experts_implementation``,
and every module of a model holds the config object the model was built from, an object
other models may hold too (``Model(config)`` and ``from_config(config)`` do not copy it).
Serving a model names ``"expertcache"`` in its config; written on a shared object, that
switched every other model built from it to the cache, which does not serve them (an error
at their next forward), and refused to enable the cache on them (their config already
named it).

So while served, a model holds copies of its config objects (`ModelConfigs`: shallow
copies, sub-configs pointing at the copies, every other value shared as before) and the
cache writes only there. ``disable()`` (`ModelConfigs.give_back`) puts the original objects
back into the model's modules with what was changed on the copies while served
(``set_experts_implementation``, ``model.config.x = y``), so a model built on its own ends
as before; only while served is ``model.config`` a copy (a change made on the original
object meanwhile reaches the model once disabled).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import PreTrainedConfig

_ABSENT = object()


@dataclass
class OwnedConfig:
    """One config object of a served model and the model's copy of it.

    Attributes:
        original: the object the model's modules held (and other models may hold).
        own: the model's copy while served.
        before: the copy's attributes as made (what counts as changed while served).
    """

    original: PreTrainedConfig
    own: PreTrainedConfig
    before: dict[str, object]


class ModelConfigs:
    """The config objects of one model's modules, copied (nothing changes until `install`)."""

    def __init__(self, model: nn.Module) -> None:
        holders = [(module, getattr(module, "config", None)) for module in model.modules()]
        originals = {id(config): config for _, config in holders if isinstance(config, PreTrainedConfig)}
        owns = {key: copy.copy(config) for key, config in originals.items()}
        for own in owns.values():
            attributes = vars(own)
            for name, value in list(attributes.items()):
                if id(value) in originals and originals[id(value)] is value:  # a sub-config: the copy's
                    attributes[name] = owns[id(value)]
        self._owned = {key: OwnedConfig(originals[key], own, dict(vars(own))) for key, own in owns.items()}
        # weak: the handle keeps no module of the model alive
        self._holders = [
            (weakref.ref(module), self._owned[id(config)]) for module, config in holders if id(config) in self._owned
        ]

    def install(self) -> None:
        """Make every module hold the model's copy of its config object."""
        for module, owned in self._modules():
            module.config = owned.own

    def give_back(self) -> None:
        """Write what changed on the copies since they were made onto the originals, and make
        the modules hold the originals again. Cannot fail (plain attribute writes)."""
        originals = {id(owned.own): owned.original for owned in self._owned.values()}
        for owned in self._owned.values():
            for name, value in vars(owned.own).items():
                if _changed(value, owned.before.get(name, _ABSENT)):
                    # into the instance dict: the name is already the stored one (no attribute_map)
                    vars(owned.original)[name] = originals.get(id(value), value)
        for module, owned in self._modules():
            if getattr(module, "config", None) is owned.own:
                module.config = owned.original

    def _modules(self) -> list[tuple[Any, OwnedConfig]]:
        """The modules still alive and the config each held (Any: nn.Module's attribute types
        do not include a config)."""
        alive = ((reference(), owned) for reference, owned in self._holders)
        return [(module, owned) for module, owned in alive if module is not None]


def _changed(now: object, before: object) -> bool:
    if now is before:
        return False
    try:
        return bool(now != before)
    except (RuntimeError, TypeError, ValueError):  # no plain comparison (a tensor): a new object is a change
        return True
