"""The layers a `SlotPool` serves: `PoolLayer`, ``attach``, and the lookups by key.

Each attached layer owns a consecutive range of the pool's keys, ``[key_offset,
key_offset + num_experts)``, one per local expert, in attach order; the tables hold keys,
never (layer, expert) pairs. A pool of several layers keeps ``key_layer``, the layer of
every key (on the device for the admission kernel, on the host for the planner), and every
layer keeps its share of the slots (`expertcache.layer_shares`; `floor`).

The functions taking ``pool`` first are `SlotPool`'s methods of the same names.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from expertcache import host_prepare
from expertcache.kernels.slot_tables import SlotTables
from expertcache.layer_shares import LayerFloor, layer_share
from expertcache.mover import CopyGroup, DecodeGroup, copy_groups
from expertcache.policies import claim_policy
from expertcache.store import CPUBackingStore
from expertcache.validation import check_expert_map

if TYPE_CHECKING:
    from expertcache.slot_pool import SlotPool


@dataclass(frozen=True)
class PoolLayer:
    """One attached layer: its store, its key range, its id map, its copy segments."""

    name: Hashable
    index: int
    key_offset: int
    store: CPUBackingStore
    num_global: int
    global_to_local: torch.Tensor | None  # [E_global] int32 on the pool's device; None = identity
    global_to_local_host: np.ndarray  # [E_global] int64
    copy_groups: tuple[CopyGroup | DecodeGroup, ...]  # how the copy (and decode) kernels move one expert

    @property
    def num_experts(self) -> int:
        return self.store.num_experts


def attach(pool: SlotPool, name: Hashable, store: CPUBackingStore, global_to_local: torch.Tensor) -> PoolLayer:
    """Serve layer ``name``'s experts from ``store``.

    Args:
        name: any hashable, unique in this pool.
        store: the layer's experts (the pool's layout).
        global_to_local: ``[E_global]`` int32/int64 map, global id -> local expert or -1,
            every local expert exactly once (`expertcache.validation.check_expert_map`).
    """
    if not isinstance(store, CPUBackingStore):
        raise TypeError(f"store must be a CPUBackingStore, got {type(store).__name__}")
    if not isinstance(global_to_local, torch.Tensor):
        raise TypeError(f"global_to_local must be a tensor, got {type(global_to_local).__name__}")
    if pool._started:
        raise RuntimeError("attach every layer to a slot pool before its first prepare()")
    try:
        hash(name)
    except TypeError:
        raise TypeError(f"a layer name must be hashable (a dict key), got {type(name).__name__} {name!r:.40}") from None
    global_to_local = check_expert_map(global_to_local, store.num_experts, name="global_to_local")
    if name in pool.layers:
        raise ValueError(f"layer {name!r} is already attached to this slot pool")
    layer_share(pool.num_slots, len(pool.layers) + 1)  # raises: more layers than slots
    pool.layout.check_compatible(store.layout, what=f"layer {name!r}")
    if pool.device.type == "cuda" and not store.pinned:
        raise ValueError("a store served to a GPU pool must be pinned (build it with pin=True)")
    key_offset = pool.tables.num_keys
    host_map = global_to_local.to(torch.int64).numpy()
    identity = np.array_equal(host_map, np.arange(store.num_experts))
    layer = PoolLayer(
        name, len(pool.layers), key_offset, store, int(host_map.size),
        None if identity else global_to_local.to(pool.device, torch.int32), host_map,
        copy_groups(store, pool.device),
    )  # fmt: skip
    tables = SlotTables.allocate(key_offset + store.num_experts, pool.num_slots, len(pool.layers) + 1, pool.device)
    ordered = [*pool.ordered_layers, layer]
    key_layer_host = np.concatenate([np.full(entry.num_experts, entry.index, dtype=np.int32) for entry in ordered])
    key_layer = pool.key_layer
    if len(ordered) > 1:
        with torch.inference_mode(False):
            key_layer = torch.from_numpy(key_layer_host).to(pool.device)
    if pool.policy is not None and not pool.layers:  # the first layer binds the policy, once nothing can fail
        claim_policy(pool.policy, capacity=pool.num_slots, owner=pool)
    pool.tables, pool.key_layer, pool._key_layer_host = tables, key_layer, key_layer_host
    pool.layers[name] = layer
    pool.ordered_layers.append(layer)
    pool._key_offsets.append(key_offset)
    return layer


def check_attached(pool: SlotPool, layer: object) -> None:
    """Every method taking a ``layer`` serves only this pool's own (`attach`'s answer):
    another pool's layer would read or write this pool's rows of the same index."""
    if not isinstance(layer, PoolLayer):
        raise TypeError(f"layer must be a PoolLayer from attach() (provider.layer), got {type(layer).__name__}")
    if pool.layers.get(layer.name) is not layer:
        raise ValueError(f"layer {layer.name!r} is not attached to this slot pool")


def floor(pool: SlotPool, layer: PoolLayer, expert_to_slot: np.ndarray) -> LayerFloor | None:
    """What a call of ``layer`` may not take from the other layers (None: a pool of one
    layer), given ``expert_to_slot`` now (a host copy)."""
    if len(pool.layers) < 2:
        return None
    held = np.bincount(pool._key_layer_host[expert_to_slot >= 0], minlength=len(pool.layers))
    return LayerFloor(layer.index, pool.share, held.tolist(), functools.partial(layer_of_key, pool))


def layer_of_key(pool: SlotPool, key: object) -> int:
    """The layer index of a key, -1 for anything that is no key of the pool (a policy's
    bad victim, refused by the planner)."""
    row = host_prepare.key_row(key, pool._key_layer_host.size)
    return -1 if row < 0 else int(pool._key_layer_host[row])


def owner_of(pool: SlotPool, key: object) -> tuple[PoolLayer, int]:
    """``(layer, local expert)`` of a key."""
    index = bisect.bisect_right(pool._key_offsets, int(key)) - 1  # type: ignore[call-overload]
    layer = pool.ordered_layers[index]
    return layer, int(key) - layer.key_offset  # type: ignore[call-overload]


def store_of(pool: SlotPool, key: object) -> tuple[CPUBackingStore, int]:
    """``(store, row)`` holding a key's expert."""
    layer, expert = pool.owner_of(key)
    return layer.store, expert
