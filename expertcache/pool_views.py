"""Read-only views of a `SlotPool`: a layer's counters and where its experts are.

    stats            exact counters of a layer's calls
    prefetch_stats   the same for its prefetches (hits already resident, misses copied)
    expert_to_slot   the slot of each of the layer's experts, or -1
    expert_in        the layer's expert a slot holds, or -1

Each reads the device tables (a sync): call them outside CUDA graphs. Each first makes the
current stream wait for copies still pending on the pool's copy stream (a prefetch's
admission writes the tables there), and leaves them pending for the pool's next call
(`expertcache.device_streams.wait_for_copies`). The functions are `SlotPool`'s methods of
the same names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from expertcache.device_streams import wait_for_copies
from expertcache.kernels.slot_tables import COUNTERS, SlotTables
from expertcache.pool_layers import PoolLayer, check_attached
from expertcache.stats import CacheStats
from expertcache.validation import check_int

if TYPE_CHECKING:
    from expertcache.slot_pool import SlotPool


def stats(pool: SlotPool, layer: PoolLayer) -> CacheStats:
    """Exact counters of ``layer``."""
    check_attached(pool, layer)
    return _counted(pool, layer, _settled(pool).counters)


def prefetch_stats(pool: SlotPool, layer: PoolLayer) -> CacheStats:
    """Counts of ``layer``'s prefetches: ``hits`` already resident, ``misses`` copied."""
    check_attached(pool, layer)
    return _counted(pool, layer, _settled(pool).prefetched)


def expert_to_slot(pool: SlotPool, layer: PoolLayer) -> np.ndarray:
    """``[E_local]`` int32 copy: the slot of each of ``layer``'s experts, or -1."""
    check_attached(pool, layer)
    start = layer.key_offset
    return _settled(pool).expert_to_slot[start : start + layer.num_experts].cpu().numpy().copy()


def expert_in(pool: SlotPool, layer: PoolLayer, slot: int) -> int:
    """Local expert of ``layer`` held by ``slot`` (an int in ``[0, num_slots)``), or -1
    (free, or another layer's)."""
    check_attached(pool, layer)
    slot = check_int("slot", slot, minimum=0, maximum=pool.num_slots - 1)
    key = int(_settled(pool).slot_to_key[slot])
    if key < 0:
        return -1
    owner, expert = pool.owner_of(key)
    return expert if owner is layer else -1


def _settled(pool: SlotPool) -> SlotTables:
    """The tables, once the current stream has waited for copies still pending on the
    copy stream (a prefetch's admission writes them there). They stay pending: the pool's
    next call joins them on its own stream, whichever thread read the view."""
    wait_for_copies(pool)
    return pool.tables


def _counted(pool: SlotPool, layer: PoolLayer, counters: torch.Tensor) -> CacheStats:
    """``layer``'s row of ``counters`` (``[L, len(COUNTERS)]``) as `CacheStats`, with the bytes
    its misses moved."""
    row = dict(zip(COUNTERS, counters[layer.index].tolist(), strict=True))
    raw, stored = pool.layout.expert_bytes, layer.store.stored_expert_bytes
    return CacheStats(**row, bytes_h2d=row["misses"] * raw, compressed_bytes_h2d=row["misses"] * stored)
