"""Expert-group passes: the one way a call with more distinct experts than slots is served.

A prefill, or a decode batch of many requests, can route its tokens to more distinct
experts than the pool has slots. Such a call runs as passes over groups of its experts;
each pass is an ordinary call of the cache (plan, move, commit + remap) restricted to its
group, and its result marks every other group's ids -1, so a fused-MoE kernel that skips
-1 computes the pass's share and the engine sums the passes::

    the call's keys, resident ones first (each kind in first-appearance order), cut into
    groups of G keys (S = the pool's share, `expertcache.layer_shares`: all slots, for one
    layer; G = S, or S // 2 for overlapped passes):
    pass 0      the resident keys  +  the first G - hits missing keys
    pass g > 0  the next G keys

so resident experts are used before anything is copied, every expert is loaded at most
once per call, and a pass never evicts a key of its own group (earlier groups are done
with their slots). A call that fits (at most S keys) is one group. The number of passes
is ``ceil(distinct keys / G)``; a CUDA graph captures `max_passes` of them (the most the
call's shape allows), the rest empty.

**Overlapped passes** (``passes(ids, overlap=True)``, for a caller that sums passes
exactly) take groups of half the share, so that in device mode the copies of pass g + 1
run on a side stream while pass g computes: under LRU a pass's misses always find enough
slots colder than the previous group's keys (hits and misses of a pass fill at most G of
the S slots the layer may take, the previous group at most G more), so those copies never
touch a slot pass g reads::

    copy stream   copy 0 | copy 1        | copy 2        | ...
    current       ...    | apply 0       | apply 1       | apply 2 ...
                           (copy g + 1 waits for apply g - 1 only)

(In device mode the first pass, the whole call when it fits, comes as its hits, then its
misses: that split copies exactly what the one pass copies.) Every mode and the simulator
group an overlapped call the same way, so the decisions stay equal.

Host mode (any policy), device mode (`expertcache.kernels.passes`, on the GPU), the
transformers integration and the EP layer run through `ExpertWeightProvider.passes`, and
the simulator (`expertcache.slot_table.SlotTable.admit_passes`) groups with
`group_passes`, so simulated copy counts are the runtime's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

Key = TypeVar("Key")

#: Calls of at most this many ids (``T * K``) take overlapped passes in
#: `expertcache.decode_stack.DecodeStack` (and in the simulator's ``overlap_max_ids``
#: replays of it); larger ones (a prefill) take passes one after the other. Measured on an
#: H200 (benchmarks/README.md, runs 38-39): overlapped passes made decode batches of 8-128
#: tokens (64-1024 ids) 1.5-2% faster and prefills of 1024 and 4096 tokens 7-8% slower
#: (twice the passes, each sorting every (token, choice) pair of the call).
OVERLAP_MAX_IDS = 1024


def group_passes(
    keys: Sequence[Key], resident: Sequence[bool], num_slots: int, *, overlap: bool = False
) -> list[tuple[Key, ...]]:
    """The groups of one call, each in first-appearance order.

    Args:
        keys: the call's distinct keys, in first-appearance order.
        resident: whether each key holds a slot now.
        num_slots: ``S``, keys one pass may hold (the pool's share).
        overlap: the passes overlap (groups of ``S // 2`` when the call does not fit).

    Returns:
        ``ceil(len(keys) / G)`` groups (one, possibly empty, when the call fits in ``S``):
        the keys, resident ones first, cut into groups of ``G = group_size(...)``.
    """
    if num_slots < 1:
        raise ValueError(f"num_slots must be positive, got {num_slots}")
    if len(keys) <= num_slots:
        return [tuple(keys)]
    size = group_size(len(keys), num_slots, overlap=overlap)
    hits = sum(bool(flag) for flag in resident)
    groups: list[list[Key]] = [[] for _ in range(pass_count(len(keys), size))]
    hit_rank = miss_rank = 0
    for key, flag in zip(keys, resident, strict=True):
        if flag:
            groups[hit_rank // size].append(key)
            hit_rank += 1
        else:
            groups[(hits + miss_rank) // size].append(key)
            miss_rank += 1
    return [tuple(group) for group in groups]


def group_size(num_keys: int, num_slots: int, *, overlap: bool = False) -> int:
    """``G``, the keys of one group: ``S`` for a call that fits or passes that do not
    overlap, else ``S // 2`` (``S`` when that is 0: a share of one slot cannot overlap)."""
    if overlap and num_keys > num_slots and num_slots >= 2:
        return num_slots // 2
    return num_slots


def pass_count(num_keys: int, group: int) -> int:
    """Passes a call of ``num_keys`` distinct keys takes in groups of ``group``: ``max(1, ceil(num_keys / G))``."""
    return max(1, -(-num_keys // group))


def max_passes(num_ids: int, num_experts: int, num_slots: int, *, overlap: bool = False) -> int:
    """The most passes a call of ``num_ids`` ids (``T * K``) over ``num_experts`` local
    experts can take with a share of ``num_slots`` (overlapped or not): what a CUDA graph
    of that shape captures."""
    most = min(num_ids, num_experts)
    return pass_count(most, group_size(most, num_slots, overlap=overlap))
