"""`replay`: run a stream of calls through a `SlotTable` under one policy and count.

Semantics are the runtime's (see `expertcache.slot_table`): each call's keys are
deduplicated in first-appearance order, hits and misses count distinct keys per call, and
no key of the current call is ever evicted. A call with more distinct keys than the
capacity cannot be admitted at once; an engine would run it in parts, and so does
``replay`` by default (``oversize="split"``: consecutive chunks of ``capacity`` distinct
keys, each admitted as its own call, counted in ``split_calls``).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from expertcache.errors import CacheCapacityError
from expertcache.policies import EvictionPolicy, make_policy
from expertcache.slot_table import SlotTable


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Counts of one replay.

    Attributes:
        hits: distinct keys of a call already resident, summed over calls.
        misses: distinct keys of a call that had to be loaded, summed over calls.
        evictions: resident keys dropped to make room.
        calls: calls admitted (after splitting oversize calls).
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

    def __add__(self, other: ReplayResult) -> ReplayResult:
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
    oversize: Literal["split", "raise"] = "split",
) -> ReplayResult:
    """Admit ``calls`` in order into a cache of ``capacity`` keys and count what happened.

    Args:
        calls: one sequence of hashable keys per call (an expert id, or ``(layer,
            expert)`` for a pool shared by layers); repeats inside a call are allowed.
        policy: a policy name (``"lru"``, ..., ``"belady"``) or a fresh `EvictionPolicy`.
        capacity: keys the cache holds (slots), at least 1.
        forward_starts: indices into ``calls`` where a forward pass starts (Least-Stale
            ranks by it); default: every call is its own forward pass.
        oversize: what to do with a call of more distinct keys than ``capacity``:
            ``"split"`` it into chunks, or ``"raise"`` `CacheCapacityError`.

    Returns:
        `ReplayResult` with hits, misses, evictions.
    """
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    admitted, starts, split = _normalize(calls, capacity, forward_starts, oversize)
    chosen = make_policy(policy, capacity=capacity)
    if chosen.clairvoyant:
        chosen.set_future(admitted)
    table = SlotTable(capacity, policy=chosen)
    hits = misses = evictions = 0
    for keys, starts_forward in zip(admitted, starts, strict=True):
        if starts_forward:
            table.begin_forward()
        admission = table.admit(keys)
        hits += len(admission.hits)
        misses += len(admission.loads)
        evictions += len(admission.evictions)
    return ReplayResult(hits, misses, evictions, len(admitted), split)


def _normalize(
    calls: Iterable[Sequence[Hashable]],
    capacity: int,
    forward_starts: Collection[int] | None,
    oversize: str,
) -> tuple[list[tuple[Hashable, ...]], list[bool], int]:
    """Distinct keys of each call (split to ``capacity``) and whether each starts a pass."""
    if oversize not in ("split", "raise"):
        raise ValueError(f"oversize must be 'split' or 'raise', got {oversize!r}")
    starts_set = None if forward_starts is None else set(forward_starts)
    admitted: list[tuple[Hashable, ...]] = []
    starts: list[bool] = []
    split = 0
    for index, call in enumerate(calls):
        unique = tuple(dict.fromkeys(call))
        starts_forward = starts_set is None or index in starts_set
        if len(unique) > capacity:
            if oversize == "raise":
                raise CacheCapacityError(len(unique), capacity, where=f"call {index}")
            split += 1
        for begin in range(0, max(len(unique), 1), capacity):
            admitted.append(unique[begin : begin + capacity])
            starts.append(starts_forward and begin == 0)
    return admitted, starts, split
