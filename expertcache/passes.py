"""Expert-group passes: the one way a call with more distinct experts than slots is served.

A prefill, or a decode batch of many requests, can route its tokens to more distinct
experts than the pool has slots. Such a call runs as passes over groups of its experts;
each pass is an ordinary call of the cache (plan, move, commit + remap) restricted to its
group, and its result marks every other group's ids -1, so a fused-MoE kernel that skips
-1 computes the pass's share and the engine sums the passes::

    the call's keys, resident ones first (each kind in first-appearance order), cut into
    groups of S = the pool's share (`expertcache.layer_shares`: all slots, for one layer):
    pass 0      the resident keys  +  the first S - hits missing keys
    pass g > 0  the next S keys

so resident experts are used before anything is copied, every expert is loaded at most
once per call, and a pass never evicts a key of its own group (earlier groups are done
with their slots). The number of passes is ``ceil(distinct keys / S)``; a CUDA graph
captures `max_passes` of them (the most the call's shape allows), the rest empty. (A
device-mode call that fits in one pass may instead be served as its hits, then its
misses, to overlap copies with compute: ``passes(ids, overlap=True)``; that split copies
exactly what the one pass copies.)

Host mode (any policy), device mode (`expertcache.kernels.passes`, on the GPU), the
transformers integration and the EP layer run through `ExpertWeightProvider.passes`, and
the simulator (`expertcache.slot_table.SlotTable.admit_passes`) groups with
`group_passes`, so simulated copy counts are the runtime's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

Key = TypeVar("Key")


def group_passes(keys: Sequence[Key], resident: Sequence[bool], num_slots: int) -> list[tuple[Key, ...]]:
    """The groups of one call, each in first-appearance order.

    Args:
        keys: the call's distinct keys, in first-appearance order.
        resident: whether each key holds a slot now.
        num_slots: ``S``, keys one pass may hold (the pool's share).

    Returns:
        ``ceil(len(keys) / S)`` groups (one, possibly empty, when everything fits): the keys,
        resident ones first, cut into groups of ``S``.
    """
    if num_slots < 1:
        raise ValueError(f"num_slots must be positive, got {num_slots}")
    if len(keys) <= num_slots:
        return [tuple(keys)]
    hits = sum(bool(flag) for flag in resident)
    groups: list[list[Key]] = [[] for _ in range(pass_count(len(keys), num_slots))]
    hit_rank = miss_rank = 0
    for key, flag in zip(keys, resident, strict=True):
        if flag:
            groups[hit_rank // num_slots].append(key)
            hit_rank += 1
        else:
            groups[(hits + miss_rank) // num_slots].append(key)
            miss_rank += 1
    return [tuple(group) for group in groups]


def pass_count(num_keys: int, num_slots: int) -> int:
    """Passes a call of ``num_keys`` distinct keys takes: ``max(1, ceil(num_keys / S))``."""
    return max(1, -(-num_keys // num_slots))


def max_passes(num_ids: int, num_experts: int, num_slots: int) -> int:
    """The most passes a call of ``num_ids`` ids (``T * K``) over ``num_experts`` local
    experts can take with passes of ``num_slots`` keys (the pool's share): what a CUDA graph
    of that shape captures."""
    return pass_count(min(num_ids, num_experts), num_slots)
