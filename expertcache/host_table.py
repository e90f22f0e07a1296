"""Host mode's copy of the ``expert -> slot`` table (numpy int32, one row per key of the
pool): read from the committed state bytes, what the planner asks of it (a victim's slot,
the free slots) and the table a plan's commit leaves. The device tables stay the truth;
this copy lives for one call (or one call's passes)."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import numpy as np

from expertcache.call_plan import CallPlan

if TYPE_CHECKING:
    from expertcache.slot_pool import SlotPool


def expert_to_slot(pool: SlotPool, committed: np.ndarray) -> np.ndarray:
    """``expert_to_slot`` as it was when ``committed`` was read (the state bytes lead with it)."""
    return committed[: pool.tables.num_keys * 4].view(np.int32)


def key_row(key: object, num_keys: int) -> int:
    """``key`` as a row of the pool's key tables, or -1 when it is no key of the pool (a
    policy's victim may be anything: it must not be read as another key's row, as -1 or a
    bool would be by numpy)."""
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, numbers.Integral):
        return -1
    row = operator.index(key)
    return row if 0 <= row < num_keys else -1


def slot_of_key(table: np.ndarray, key: object) -> int:
    """The slot of a victim ``key`` in ``table`` (``expert_to_slot``), -1 when it holds none
    or is no key (`call_plan` then refuses it as not evictable)."""
    row = key_row(key, table.size)
    return -1 if row < 0 else int(table[row])


def free_slots_in(table: np.ndarray, num_slots: int) -> Iterator[int]:
    """The slots no key of ``table`` (``expert_to_slot``) holds, in slot order."""
    occupied = np.zeros(num_slots, dtype=bool)
    occupied[table[table >= 0]] = True
    return iter(np.flatnonzero(~occupied).tolist())


def apply_plan(table: np.ndarray, plan: CallPlan) -> None:
    """``table`` (``expert_to_slot``) as the commit of ``plan`` leaves it on the device."""
    for load in plan.loads:
        if load.evicted is not None:
            table[cast(int, load.evicted)] = -1
        table[cast(int, load.key)] = load.slot
