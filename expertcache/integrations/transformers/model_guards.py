"""What a served model refuses beyond its experts modules' `save_guard.SaveGuard`: loads into
the served experts, and ``save_pretrained`` before it writes anything.

* ``load_state_dict`` with an entry for a served expert parameter: plain, it loaded every
  other module's weights and then failed on the placeholders' shapes (a half-loaded model);
  with ``assign=True`` and placeholder-shaped entries it swapped the placeholders out from
  under the cache (stale experts served, ``disable()`` restoring Parameters the model no
  longer held). A `LoadGuard`, the load-state-dict pre-hook of every module from the served
  model down to each expert block (a load may start at any of them), refuses such a load
  before any module has loaded. Entries for other modules load as before, plain or
  ``assign=True``: the cache holds none of their parameters.
* ``save_pretrained`` makes the folder and writes ``config.json`` before it asks for the
  state dict that the experts' SaveGuard refuses. Every transformers model among those
  modules gets a SaveGuard as its ``save_pretrained`` (an instance attribute over the
  class's method), which refuses at the call, before anything is written.

`guard_model` installs both; ``disable()`` removes them (`ModelGuards.remove`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from torch import nn
from transformers import PreTrainedModel

from expertcache.integrations.transformers.discovery import ExpertBlock
from expertcache.integrations.transformers.save_guard import SaveGuard

_ABSENT = object()


class LoadGuard:
    """Refuses a ``load_state_dict`` that holds entries for served expert parameters (a
    load-state-dict pre-hook; plain data, so copies and pickles of a model carry it as they
    carry the SaveGuard, which refuses them).

    Args:
        names: the served expert parameters below the hooked module, by qualified name from it.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *rest: object) -> None:
        entries = [prefix + name for name in self.names if prefix + name in state_dict]
        if entries:
            more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
            raise RuntimeError(
                f"load_state_dict() into a model served by an expert cache, with entries for its served experts "
                f"({entries[0]}{more}): while served, those parameters are empty placeholders (the weights are in "
                f"the cache), which the load would fill or, with assign=True, replace without the cache seeing it. "
                f"Call disable() on the ExpertCacheHandle, load, then enable_expert_cache again; nothing was loaded"
            )


@dataclass
class ModelGuards:
    """The guards on one served model (removed by `remove`; weak: they keep no module alive).

    Attributes:
        hooks: the LoadGuards' hook handles.
        saves: (module, its SaveGuard as ``save_pretrained``, the instance attribute it covered).
    """

    hooks: list = field(default_factory=list)
    saves: list[tuple[weakref.ref, SaveGuard, object]] = field(default_factory=list)

    def remove(self) -> None:
        """Take every guard away (plain attribute and dict writes: cannot fail)."""
        for hook in self.hooks:
            hook.remove()
        for reference, guard, covered in self.saves:
            module = reference()
            if module is None or vars(module).get("save_pretrained") is not guard:
                continue
            if covered is _ABSENT:
                del vars(module)["save_pretrained"]
            else:
                vars(module)["save_pretrained"] = covered
        self.hooks, self.saves = [], []


def guard_model(model: nn.Module, blocks: list[ExpertBlock]) -> ModelGuards:
    """Install a `LoadGuard` on every module from ``model`` down to each block, and a
    `SaveGuard` as ``save_pretrained`` on each of them that is a transformers model."""
    guards = ModelGuards()
    where = type(blocks[0].module).__name__
    for path, names in _served_below(blocks).items():
        module = model.get_submodule(path)
        guards.hooks.append(module.register_load_state_dict_pre_hook(LoadGuard(tuple(names))))
        if isinstance(module, PreTrainedModel):
            guard = SaveGuard(where, "save_pretrained()")
            covered = vars(module).get("save_pretrained", _ABSENT)
            vars(module)["save_pretrained"] = guard
            guards.saves.append((weakref.ref(module), guard, covered))
    return guards


def _served_below(blocks: list[ExpertBlock]) -> dict[str, list[str]]:
    """Module path (``""``: the model) -> the served expert parameters below it, by name from it."""
    below: dict[str, list[str]] = {}
    for block in blocks:
        parts = block.name.split(".") if block.name else []
        for depth in range(len(parts) + 1):
            rest = ".".join(parts[depth:])
            below.setdefault(".".join(parts[:depth]), []).extend(
                f"{rest}.{name}" if rest else name for name in block.parameter_names
            )
    return below
