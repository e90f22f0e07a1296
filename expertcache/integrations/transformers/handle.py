"""`ExpertCacheHandle`: what `enable_expert_cache` returns for a model it serves.

The handle reports the cache's statistics (per expert block and in total), the providers
serving each block and the bytes they hold; ``disable()`` puts the original weights back
(`serving.restored_weights`, then `serving.put_back` for every block once all are built),
all or nothing, re-selects the experts implementation each config names now, removes the
guards against loading and saving (`model_guards`) and gives the model its original config
objects back (`model_configs`).
`enable_expert_cache` and `check_cache_size`, which make the handle, live in `enabling`
and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from expertcache.cached_provider import CachedWeightProvider
from expertcache.config import ExpertCacheConfig
from expertcache.integrations.transformers import dispatch
from expertcache.integrations.transformers.enabling import check_cache_size, enable_expert_cache
from expertcache.integrations.transformers.model_configs import ModelConfigs
from expertcache.integrations.transformers.model_guards import ModelGuards
from expertcache.integrations.transformers.serving import (
    ServedBlock,
    bytes_needed,
    free_bytes,
    put_back,
    restore_targets,
    restored_weights,
)
from expertcache.stats import CacheStats
from expertcache.trace.recorder import RoutingRecorder

__all__ = [
    "RESTORE_TARGETS",
    "ExpertCacheHandle",
    "ExpertCacheStats",
    "check_cache_size",
    "enable_expert_cache",
]


#: Where ``disable(to=...)`` puts the experts back.
RESTORE_TARGETS = ("original", "cpu")


@dataclass(frozen=True)
class ExpertCacheStats:
    """Counters of a model's cache.

    Attributes:
        per_layer: expert-block module name -> that layer's `CacheStats`.
        total: the sum over layers.
    """

    per_layer: Mapping[str, CacheStats]
    total: CacheStats


class ExpertCacheHandle:
    """A model whose expert blocks are served by the cache (returned by `enable_expert_cache`).

    Attributes:
        config: the cache settings in force.
        recorder: the `RoutingRecorder` fed by every MoE layer, or None.
    """

    def __init__(
        self,
        config: ExpertCacheConfig,
        served: list[ServedBlock],
        recorder: RoutingRecorder | None,
        expert_bytes: int,
        model_configs: ModelConfigs,
        guards: ModelGuards,
    ) -> None:
        self.config = config
        self.recorder = recorder
        self._served = served
        self._model_configs = model_configs
        self._guards = guards
        self._layers = tuple(item.block.name for item in served)
        self._final_stats: ExpertCacheStats | None = None
        self._expert_bytes = expert_bytes

    @property
    def enabled(self) -> bool:
        return self._final_stats is None

    @property
    def layers(self) -> tuple[str, ...]:
        """Module names of the served expert blocks, in model order."""
        return self._layers

    def provider(self, layer: str) -> CachedWeightProvider:
        """The provider serving expert block ``layer`` (its read-only views: resident, slot_of)."""
        if not self.enabled:
            raise RuntimeError("the expert cache was disabled; its providers are gone")
        for item in self._served:
            if item.block.name == layer:
                return item.provider
        raise KeyError(f"{layer!r} is not a served expert block; served: {self.layers}")

    @property
    def stats(self) -> ExpertCacheStats:
        """Hits, misses, evictions and bytes copied, per layer and in total."""
        if self._final_stats is not None:
            return self._final_stats
        per_layer = {item.block.name: item.provider.stats for item in self._served}
        total = sum(per_layer.values(), CacheStats())
        return ExpertCacheStats(MappingProxyType(per_layer), total)

    @property
    def slot_bytes(self) -> int:
        """Bytes of the slot buffers on the cache's device (every pool counted once; 0 once
        disabled)."""
        pools = {id(item.provider.pool): item.provider.pool for item in self._served}
        return sum(pool.nbytes for pool in pools.values())

    @property
    def expert_bytes(self) -> int:
        """Bytes the served expert parameters take when fully resident."""
        return self._expert_bytes

    def disable(self, to: str = "original") -> None:
        """Put the expert weights back into the model and stop serving it, all or nothing.

        The same values and shapes come back, into the same Parameter objects (or the new
        empty ones a conversion put in their place: `serving.current_placeholder`), in each
        placeholder's current dtype (a ``model.to(dtype)`` since enabling is honoured), and the experts
        implementation selected now (the one in force when the cache was enabled, or what
        ``model.set_experts_implementation`` chose since) stays selected. The model's
        modules hold their original config objects again (the model held copies while
        served, `model_configs`), with what was changed on the copies since.

        Args:
            to: ``"original"``: on the device each placeholder is on now, which is where
                the experts were when the cache was enabled unless ``model.to()`` moved
                the model since (then where it moved them: the model stays on one device).
                ``"cpu"``: in host memory, whatever the model's device (for a model whose
                experts do not fit its GPU: move or save it afterwards).

        Raises:
            ValueError: ``to`` is neither, or a placeholder is on the meta device (moved
                there); RuntimeError: a GPU cannot hold the experts
                (checked against its free memory before anything is allocated), or the
                restore failed. In every case nothing changed: the cache still serves
                the model.
        """
        if to not in RESTORE_TARGETS:
            raise ValueError(f"disable(to=...) takes 'original' or 'cpu', got {to!r}")
        if not self.enabled:
            return
        device = torch.device("cpu") if to == "cpu" else None
        taken = dispatch.served_parameter_ids()
        targets = [restore_targets(item, taken) for item in self._served]
        _check_not_meta(self._served, targets)
        self._check_room(bytes_needed(self._served, device, targets))
        final = self.stats
        try:
            pairs = zip(self._served, targets, strict=True)
            weights = [restored_weights(item, device, filled) for item, filled in pairs]
        except torch.OutOfMemoryError as error:
            raise RuntimeError(
                f"disable(to={to!r}) ran out of memory putting the experts back: nothing changed, the cache "
                f"still serves the model; free memory or call disable(to='cpu')"
            ) from error
        chosen = self._chosen_implementations()  # read before unbinding: the bindings know it
        # Nothing below can fail: the model switches back in one step.
        for item, restored, filled in zip(self._served, weights, targets, strict=True):
            dispatch.unbind(item.block.module)
            put_back(item, restored, filled)
        for block_config, name in chosen:
            dispatch.set_config_implementation(block_config, name)
        self._guards.remove()
        self._model_configs.give_back()  # with the implementation chosen, if one was since enabling
        self._served = []  # drops the providers: the slots and the pinned store are freed
        self._final_stats = final

    def _chosen_implementations(self) -> list[tuple[object, str]]:
        """Each served config copy and the implementation its blocks run now (or were told to
        run since their last call), which it names once disabled."""
        chosen: dict[int, tuple[object, str]] = {}
        for item in self._served:
            binding = dispatch.binding_of(item.block.module)
            if binding is not None and binding.config is not None and id(binding.config) not in chosen:
                name = dispatch.chosen_implementation(binding.config, binding.implementation)
                chosen[id(binding.config)] = (binding.config, name)
        return list(chosen.values())

    def _check_room(self, needed: dict[torch.device, int]) -> None:
        for device, size in needed.items():
            free = free_bytes(device)
            if free is not None and size > free:
                raise RuntimeError(
                    f"disable() needs {size / 2**30:.2f} GiB on {device} to put the experts back, but only "
                    f"{free / 2**30:.2f} GiB are free there: nothing changed, the cache still serves the model. "
                    f"Call disable(to='cpu') to put them in host memory instead"
                )

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return f"ExpertCacheHandle({len(self._served)} expert blocks, {self.config}, {state})"


def _check_not_meta(served, targets) -> None:
    """Refuse to restore a served parameter whose placeholder is on the meta device (moved
    there): the experts would lose their values there, or fail to land midway."""
    for item, filled in zip(served, targets, strict=True):
        for name, parameter in filled.items():
            current = item.block.module._parameters.get(name)
            if parameter.device.type == "meta" or (current is not None and current.device.type == "meta"):
                raise ValueError(
                    f"{item.block.name}.{name} is on the meta device, where its experts cannot be put back: move "
                    f"its placeholder to a real device first (it holds no values: module.to_empty(device=...) "
                    f"does it); nothing changed"
                )
