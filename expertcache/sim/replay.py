"""`replay`: run a stream of calls through a `SlotTable` under one policy and count.

Semantics are the runtime's (see `expertcache.slot_table`): each call's keys are
deduplicated in first-appearance order, hits and misses count distinct keys per call, and
no key of the current call is ever evicted. A call with more distinct keys than the
capacity cannot be admitted at once; the runtime serves it in expert-group passes
(`expertcache.passes`: resident keys first, then groups of misses), and so does
``replay`` by default (``oversize="passes"``; such calls are counted in ``split_calls``),
so simulated copies are the runtime's. ``oversize="overlapped"`` groups them as
``passes(ids, overlap=True)`` does (groups of half the share), as a decode stack serves
them; with ``overlap_max_ids`` only calls of at most that many ids, as `DecodeStack`
(`expertcache.passes.OVERLAP_MAX_IDS`), the larger ones as plain passes.

A pool shared by several layers (``num_layers``, ``layer_of``) keeps each layer's share,
``capacity // num_layers``, as the runtime's does (`expertcache.layer_shares`); a call is
then oversize beyond the share.

A cache that can hold every distinct key the calls use never evicts, whatever its policy, so
a named policy runs on a table of ``min(capacity, max(distinct keys, layers x largest
call))`` slots: the memory a replay takes follows the calls, not the capacity asked for
(``capacity=2**40`` is fine).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral, Number
from typing import Literal

import numpy as np
import torch

from expertcache.errors import CacheCapacityError
from expertcache.layer_shares import check_layers, layer_share
from expertcache.policies import EvictionPolicy, make_policy
from expertcache.slot_table import SlotTable
from expertcache.validation import check_int

#: How `replay` serves a call of more distinct keys than its share (see the module docstring).
OVERSIZE = ("passes", "overlapped", "raise")


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Counts of one replay.

    Attributes:
        hits: distinct keys of a call already resident, summed over calls.
        misses: distinct keys of a call that had to be loaded, summed over calls.
        evictions: resident keys dropped to make room.
        calls: calls admitted, each expert-group pass of an oversize call counted.
        split_calls: input calls that had more distinct keys than ``capacity``.
    """

    hits: int
    misses: int
    evictions: int
    calls: int
    split_calls: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """hits / lookups; 1.0 when there was no lookup."""
        return self.hits / self.lookups if self.lookups else 1.0

    def __add__(self, other: object) -> ReplayResult:
        if not isinstance(other, ReplayResult):
            return NotImplemented  # Python's TypeError names both types
        return ReplayResult(
            self.hits + other.hits,
            self.misses + other.misses,
            self.evictions + other.evictions,
            self.calls + other.calls,
            self.split_calls + other.split_calls,
        )


def replay(
    calls: Iterable[Sequence[Hashable]],
    *,
    policy: str | EvictionPolicy,
    capacity: int,
    forward_starts: Collection[int] | None = None,
    oversize: Literal["passes", "overlapped", "raise"] = "passes",
    num_layers: int = 1,
    layer_of: Callable[[Hashable], int] | None = None,
    overlap_max_ids: int | None = None,
    num_ids: Sequence[int] | None = None,
) -> ReplayResult:
    """Admit ``calls`` in order into a cache of ``capacity`` keys and count what happened.

    Args:
        calls: one sequence of hashable keys per call (an integer expert id, or ``(layer,
            expert)`` for a pool shared by layers; other hashables, such as str, are keys as
            they are); repeats inside a call are allowed. A 1-D numpy array or tensor of
            integer ids counts them by value. A float (NaN included), bool, complex or
            tensor key, or one inside a tuple key, is refused.
        policy: a policy name (``"lru"``, ..., ``"belady"``) or a fresh `EvictionPolicy`.
        capacity: keys the cache holds (slots), at least 1.
        forward_starts: indices into ``calls`` where a forward pass starts (Least-Stale
            ranks by it); default: every call is its own forward pass.
        oversize: what to do with a call of more distinct keys than the share (``capacity``
            for one layer): serve it in expert-group ``"passes"`` (as the runtime does), in
            ``"overlapped"`` passes (as ``passes(ids, overlap=True)`` does), or ``"raise"``
            `CacheCapacityError`.
        num_layers: layers sharing the cache (at most ``capacity``); each call is one layer's.
        layer_of: the layer of a key, in ``[0, num_layers)`` (needed for several layers;
            with one layer, checked: every key's must be 0).
        overlap_max_ids: with ``oversize="overlapped"``, replay a call of more ids than this
            as passes one after the other (`DecodeStack` overlaps calls of at most
            `expertcache.passes.OVERLAP_MAX_IDS` ids); None: every call overlapped.
        num_ids: ids of each call (``T * K``, as the runtime gets them), for
            ``overlap_max_ids``; default: each call's length, repeats included.

    Returns:
        `ReplayResult` with hits, misses, evictions.

    Raises:
        ValueError: capacity below 1, an unknown ``oversize``, a
            ``forward_starts`` entry that is not a non-negative int, a policy instance built for
            another capacity, ``num_layers`` below 1 (or above ``capacity``, or
            without ``layer_of``), a call holding keys of several layers or a ``layer_of``
            outside ``[0, num_layers)`` (naming the call), ``overlap_max_ids`` not a positive
            int or given without ``oversize="overlapped"``, ``num_ids`` without it or not
            one count per call; TypeError: ``calls`` not iterable (a `RoutingTrace`, a
            `TraceCalls`), a call that is not a sequence of hashable keys (an
            array or tensor: not 1-D, or of float or bool ids; a list: a float, bool,
            complex or tensor key), or a ``capacity``,
            ``num_layers`` or ``num_ids`` entry that is not an integer (a bool, a float).
        CacheCapacityError: an oversize call with ``oversize="raise"``.
    """
    capacity = check_int("capacity", capacity, minimum=1)
    if isinstance(policy, EvictionPolicy) and policy.capacity != capacity:
        raise ValueError(f"the policy instance was built for capacity {policy.capacity}, the replay has {capacity}")
    check_layers(num_layers, layer_of)
    share = layer_share(capacity, num_layers)
    admitted, starts, split, sizes = _normalize(calls, share, forward_starts, oversize, num_layers)
    overlapped = _overlapped_calls(oversize, overlap_max_ids, num_ids, sizes)
    if not isinstance(policy, EvictionPolicy):
        # no eviction beyond this, and no call is larger than its share, so the passes are the same
        largest = max((len(keys) for keys in admitted), default=1)
        capacity = min(capacity, max(num_layers, len(set().union(*admitted)), num_layers * largest))
    chosen = make_policy(policy, capacity=capacity)
    if chosen.clairvoyant:
        chosen.set_future(admitted)
    table = SlotTable(capacity, policy=chosen, num_layers=num_layers, layer_of=layer_of)
    hits = misses = evictions = passes = 0
    for index, (keys, starts_forward) in enumerate(zip(admitted, starts, strict=True)):
        if starts_forward:
            table.begin_forward()
        try:
            admissions = table.admit_passes(keys, overlap=overlapped[index])
        except ValueError as error:  # keys of several layers, or a layer_of out of range
            raise ValueError(f"call {index}: {error}") from None
        for admission in admissions:
            hits += len(admission.hits)
            misses += len(admission.loads)
            evictions += len(admission.evictions)
            passes += 1
    return ReplayResult(hits, misses, evictions, passes, split)


def _normalize(
    calls: Iterable[Sequence[Hashable]],
    capacity: int,
    forward_starts: Collection[int] | None,
    oversize: str,
    num_layers: int,
) -> tuple[list[tuple[Hashable, ...]], list[bool], int, list[int]]:
    """Distinct keys of each call, whether each starts a forward pass, the oversize calls
    and each call's length (repeats included)."""
    if oversize not in OVERSIZE:
        raise ValueError(f"oversize must be one of {OVERSIZE}, got {oversize!r}")
    if not isinstance(calls, Iterable):
        raise TypeError(
            f"calls must be an iterable of calls (one sequence of keys each), got a {type(calls).__name__}: "
            "for a RoutingTrace call replay_trace(trace, ...), for a TraceCalls replay_streams([stream], ...)"
        )
    calls = list(calls)
    starts_set = None if forward_starts is None else _call_indices(forward_starts)
    admitted: list[tuple[Hashable, ...]] = []
    starts: list[bool] = []
    split = 0
    sizes: list[int] = []
    for index, call in enumerate(calls):
        unique, size = _distinct_keys(call, index)
        sizes.append(size)
        starts_forward = starts_set is None or index in starts_set
        if len(unique) > capacity:
            if oversize == "raise":
                raise CacheCapacityError(len(unique), capacity, where=f"call {index}", layers=num_layers)
            split += 1
        admitted.append(unique)
        starts.append(starts_forward)
    return admitted, starts, split, sizes


def _distinct_keys(call: object, index: int) -> tuple[tuple[Hashable, ...], int]:
    """The call's distinct keys in first-appearance order, and its length."""
    if isinstance(call, (np.ndarray, torch.Tensor)):
        call = _array_keys(call, index)
    if isinstance(call, (str, bytes)) or not isinstance(call, Iterable):
        raise TypeError(f"call {index} must be a sequence of keys, got {type(call).__name__}")
    keys = list(call)
    try:
        unique = tuple(dict.fromkeys(keys))
    except TypeError:
        raise TypeError(f"call {index} holds a key that is not hashable") from None
    if not all(type(key) is int for key in unique):  # the common case: one type test a key
        for key in unique:
            _check_key(key, index)
    return unique, len(keys)


def _check_key(key: object, index: int, *, within: object = None) -> None:
    """Refuse a key that is a number but no integer, or a tensor, also inside a tuple key:
    NaN is not equal to itself and a tensor hashes by identity (one id, several keys), a
    float or bool is no expert id (a router's weights or a mask passed by mistake)."""
    if isinstance(key, tuple):
        for part in key:
            _check_key(part, index, within=key if within is None else within)
        return
    number = isinstance(key, Number) and not isinstance(key, Integral)
    if number or isinstance(key, (bool, np.bool_, torch.Tensor)):
        where = "" if within is None else f" (in the key {within!r})"
        raise TypeError(
            f"call {index} holds a {type(key).__name__} key {key!r}{where}; expert ids are integers "
            "(a router's topk_ids, as Python or numpy ints)"
        )


def _array_keys(call: np.ndarray | torch.Tensor, index: int) -> list:
    """A 1-D integer array's or tensor's ids as Python ints (a tensor's elements are 0-d
    tensors, which hash by identity: the same id twice would be two keys)."""
    if call.ndim != 1:
        raise TypeError(
            f"call {index} must be a 1-D sequence of keys, got a {call.ndim}-D {type(call).__name__} "
            "(flatten a call's [T, K] ids)"
        )
    if isinstance(call, torch.Tensor):
        numbers = not (call.dtype.is_floating_point or call.dtype.is_complex or call.dtype == torch.bool)
    else:
        numbers = call.dtype.kind not in "fcb"
    if not numbers:  # a float id is no expert, and NaN is not equal to itself: each a new key
        raise TypeError(f"call {index} holds {call.dtype} ids; expert ids are integers (a router's topk_ids)")
    return call.tolist()


def check_overlap_limit(oversize: str, overlap_max_ids: object) -> None:
    """``overlap_max_ids`` is None, or a positive int with ``oversize="overlapped"`` (ValueError)."""
    if overlap_max_ids is None:
        return
    if oversize != "overlapped":
        raise ValueError(f"overlap_max_ids applies to oversize='overlapped' only, got oversize={oversize!r}")
    if not isinstance(overlap_max_ids, Integral) or isinstance(overlap_max_ids, bool) or overlap_max_ids < 1:
        raise ValueError(f"overlap_max_ids must be a positive int, got {overlap_max_ids!r}")


def _overlapped_calls(
    oversize: str, overlap_max_ids: int | None, num_ids: Sequence[int] | None, sizes: list[int]
) -> list[bool]:
    """Whether each call is grouped as overlapped passes (`replay`'s ``overlap_max_ids``)."""
    check_overlap_limit(oversize, overlap_max_ids)
    if num_ids is not None:
        if overlap_max_ids is None:
            raise ValueError("num_ids is read only with overlap_max_ids")
        num_ids = [check_int(f"num_ids[{index}]", count, minimum=0) for index, count in enumerate(num_ids)]
        if len(num_ids) != len(sizes):
            raise ValueError(f"num_ids must hold one non-negative int per call ({len(sizes)}), got {len(num_ids)}")
        sizes = num_ids
    if oversize != "overlapped":
        return [False] * len(sizes)
    return [overlap_max_ids is None or size <= overlap_max_ids for size in sizes]


def _call_indices(forward_starts: Collection[int]) -> set[int]:
    """The starts as a set (an index past the last call starts a pass that never comes)."""
    indices: set[int] = set()
    for start in forward_starts:
        if isinstance(start, bool) or not isinstance(start, Integral) or start < 0:
            raise ValueError(f"forward_starts must be non-negative call indices, got {start!r}")
        indices.add(int(start))
    return indices
