"""A host-mode call's distinct keys: its ids range-checked, mapped global -> local and
deduplicated in first-appearance order (``key_offset + local expert``).

A call of fewer than `DEVICE_KEYS_MIN_IDS` ids reads every id to the host (`local_keys`);
a larger one finds each expert's first position on the device (`first_positions`, no
sync) and reads only that summary (`keys_from_first_positions`). Both give the same keys.
Reading them, in the call's one sync, is `expertcache.host_prepare`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from expertcache.validation import check_id_bounds

if TYPE_CHECKING:
    from expertcache.pool_layers import PoolLayer


#: Calls of at least this many ids find their distinct experts on the device (each expert's
#: first position, ``E_global`` values read back) instead of reading every id to the host: at
#: 4096 tokens x top-8 the host's deduplication alone took ~1.3 ms a layer, with the GPU idle.
DEVICE_KEYS_MIN_IDS = 1024


def first_positions(flat_ids: torch.Tensor, num_global: int) -> torch.Tensor:
    """``[E_global + 2]`` int64, on the ids' device, without a sync: the first flat position of
    every global id (``N`` = absent; ids outside the range count as their nearest valid id
    here), then the smallest and the largest id."""
    positions = torch.arange(flat_ids.numel(), device=flat_ids.device)
    first = torch.full((num_global,), flat_ids.numel(), dtype=torch.int64, device=flat_ids.device)
    first.scatter_reduce_(0, flat_ids.long().clamp(0, num_global - 1), positions, "amin")
    low, high = torch.aminmax(flat_ids.long())
    return torch.cat([first, low.reshape(1), high.reshape(1)])


def keys_from_first_positions(layer: PoolLayer, summary: np.ndarray, num_ids: int) -> list[int]:
    """`local_keys` from `first_positions`' summary (read to the host).

    Raises:
        IndexError: an id outside ``[0, E_global)``.
    """
    first = summary[:-2]
    if num_ids:
        check_id_bounds(int(summary[-2]), int(summary[-1]), layer.num_global)
    seen = np.flatnonzero(first < num_ids)
    local = layer.global_to_local_host[seen[np.argsort(first[seen], kind="stable")]]
    return (local[local >= 0] + layer.key_offset).tolist()


def local_keys(layer: PoolLayer, ids_host: np.ndarray) -> list[int]:
    """The call's distinct keys (``key_offset + local expert``) in first-appearance order.

    Raises:
        IndexError: an id outside ``[0, E_global)``.
    """
    flat = ids_host.reshape(-1)
    if flat.size:
        check_id_bounds(int(flat.min()), int(flat.max()), layer.num_global)
    local = layer.global_to_local_host[flat]
    local = local[local >= 0]
    _, first = np.unique(local, return_index=True)
    return (local[np.sort(first)] + layer.key_offset).tolist()
