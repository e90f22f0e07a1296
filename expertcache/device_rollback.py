"""Device mode's atomicity: a call, a pass or a prefetch either completes or changes nothing.

Before its launches a device-mode step snapshots the pool's state buffer (one device copy,
into ``pool.backup``); if the admission or the copy raises, `undone_on_error` puts back the
slots the admission planned to overwrite (the plan read on the host: one sync, only on
this path) and then the state. Inside a CUDA graph capture nothing runs until replay, so
nothing is snapshot there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from expertcache.call_plan import Load
from expertcache.device_streams import capturing
from expertcache.kernels.slot_tables import SlotTables
from expertcache.mover import restore_slots

if TYPE_CHECKING:
    from expertcache.slot_pool import SlotPool


@contextlib.contextmanager
def undone_on_error(
    pool: SlotPool, tables: SlotTables, slots: dict[str, torch.Tensor], copy_stream: torch.cuda.Stream | None
) -> Iterator[None]:
    """Snapshot the state; if the body raises, put back its slots and then the state."""
    backup = _snapshot(pool, tables.buffer)
    try:
        yield
    except BaseException:
        if copy_stream is not None:  # a copy enqueued there must land before the slots are put back
            torch.cuda.current_stream(pool.device).wait_stream(copy_stream)
        if backup is not None:
            _roll_back(pool, tables, slots, backup)
        raise


def planned_loads(tables: SlotTables) -> list[Load]:
    """The plan's loads, read on the host (one sync)."""
    entries = tables.plan_on_host().tolist()
    return [Load(key, slot, None if evicted < 0 else evicted) for _, slot, key, evicted in entries]


def _snapshot(pool: SlotPool, state: torch.Tensor) -> torch.Tensor | None:
    """A copy of the state to roll back to; none inside a capture (nothing runs until replay)."""
    if capturing(pool):
        return None
    if pool.backup is None or pool.backup.shape != state.shape:
        with torch.inference_mode(False):
            pool.backup = torch.empty_like(state)
    return pool.backup.copy_(state)


def _roll_back(pool: SlotPool, tables: SlotTables, slots: dict[str, torch.Tensor], backup: torch.Tensor) -> None:
    """Undo a call that failed after admission ran: its slots, then its tables (syncs)."""
    if torch.equal(tables.buffer, backup):
        return  # the admission never ran: nothing to undo
    restore_slots(slots, planned_loads(tables), pool.store_of)
    tables.buffer.copy_(backup)
