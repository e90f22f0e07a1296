"""The streams of a device-mode pool: whether the current one is capturing a CUDA graph,
enqueueing on the pool's copy stream, and joining that stream again.

An overlapped call (`expertcache.device_overlap`) and a prefetch (`expertcache.pool_prefetch`)
admit and copy on the pool's copy stream (`SlotPool.copy_stream`; none on the CPU, where
launches run in order), after what the current stream holds (`on_stream`). While
``pool.copies_pending`` is set the current stream has yet to wait for them: the pool's next
call joins them (`join_copies`) before its admission rewrites the plan they read; a
read-only view waits for them (`wait_for_copies`) and leaves them to that call.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from expertcache.slot_pool import SlotPool


def capturing(pool: SlotPool) -> bool:
    """Whether the pool's device's current stream is capturing a CUDA graph."""
    if pool.device.type != "cuda":
        return False
    with torch.cuda.device(pool.device):
        return torch.cuda.is_current_stream_capturing()


def on_stream(stream: torch.cuda.Stream | None):
    """Enqueue on ``stream`` after what the current stream holds (a no-op for None)."""
    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    return torch.cuda.stream(stream)


def recorded(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event recorded on ``stream`` now (None for no stream)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_for_copies(pool: SlotPool) -> None:
    """Make the current stream wait for what the pool's copy stream still runs, and leave the
    copies pending: a reader (``stats``, ``resident``, maybe on a metrics thread) must see the
    tables the copy stream writes, but the pool's next call still joins them on its own stream."""
    copy_stream = pool.copy_stream() if pool.copies_pending else None
    if copy_stream is not None:
        torch.cuda.current_stream(pool.device).wait_stream(copy_stream)


def join_copies(pool: SlotPool) -> None:
    """Make the current stream wait for what the pool's copy stream still runs: copies an
    overlapped call left there whose misses pass was never asked for (an error in the
    caller's kernel, a generator held open, another layer of a shared pool or another thread
    in between), or a prefetch. The next call's admission rewrites the plan those copies
    read, and reads of the tables must see what they wrote. (A finished overlapped call has
    joined already.)"""
    if pool.copies_pending:
        copy_stream = pool.copy_stream()
        if copy_stream is not None:  # pending copies only ever run on one
            torch.cuda.current_stream(pool.device).wait_stream(copy_stream)
        pool.copies_pending, pool.copy_inputs = False, ()
