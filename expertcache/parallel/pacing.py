"""`CopyPacer`: hold host -> GPU expert copies back while a collective is in flight.

Under expert parallelism a rank copies its missed experts while the layer's token
all-gather may still be running. Where both share a link (collectives over PCIe, or a
host memory system that both saturate), the copies can slow the collective that every rank
waits for, while the copied expert is needed only later by this rank. The pacer trades the
overlap for an unhindered collective:

* copies go in chunks of ``chunk_bytes`` (one expert is ~9.4 MB for Qwen3-30B-A3B);
* before each chunk, when a tracked collective has not completed, the copy is ordered
  after it (``Work.wait()``: on CUDA the current stream waits, the host does not block)
  and counted as a hold.

In the host-driven cache a call's copies are issued in one burst right after the
collective, so the first chunk takes the hold and the rest queue behind it; the per-chunk
check matters once copies are issued over time (a background prefetcher).

Off by default; `CopyPacer.engaged` is false with a single rank, where there is no
collective to protect. It hooks into the copy path through `SlotPool.copy_expert` only
(every copy in host mode; in device mode only an eager prefill's, which the copy engine
moves) and never changes which bytes land where. `ExpertParallelMoE` routes a pool's copies
through its pacer for the span of its own call only (`CopyPacer.pacing`): pacing belongs to
the layer that asked for it, and another layer over the same `LocalExperts`, or a direct
``prepare``, copies as it would without. Whether it helps is a measurement
(``benchmarks/bench_ep.py``): on NVLink-connected GPUs the collective does not cross PCIe
and pacing can only remove overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from expertcache.parallel.collectives import PendingWork
from expertcache.slot_pool import SlotPool
from expertcache.validation import check_flag, check_int

#: Chunk size by default: 4 MiB pinned copies still reach ~40 GB/s on an H200 (DESIGN.md).
DEFAULT_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class PacingStats:
    """Counters of one pacer.

    Attributes:
        experts: experts copied through the pacer.
        chunks: copies issued (a tensor of ``B`` bytes takes ``ceil(B / chunk_bytes)``).
        holds: times a chunk was ordered after a collective still in flight.
    """

    experts: int = 0
    chunks: int = 0
    holds: int = 0


class CopyPacer:
    """Chunks expert copies and holds them behind the tracked collective.

    Args:
        world_size: ranks of the process group, an int >= 1; the pacer engages only when
            above 1.
        enabled: ask for pacing (default off), True or False.
        chunk_bytes: bytes per copy chunk, an int >= 1.
    """

    def __init__(self, *, world_size: int, enabled: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        world_size = check_int("world_size", world_size, minimum=1)
        enabled = check_flag("enabled", enabled)
        chunk_bytes = check_int("chunk_bytes", chunk_bytes, minimum=1)
        self.engaged = enabled and world_size > 1
        self.chunk_bytes = chunk_bytes
        self._in_flight: PendingWork | None = None
        self._stats = PacingStats()

    @property
    def stats(self) -> PacingStats:
        return self._stats

    def install(self, pool: SlotPool) -> None:
        """Route ``pool``'s copies through this pacer from now on when engaged; else leave it
        alone (for a provider driven outside a layer; a layer uses `pacing`)."""
        if self.engaged:
            pool.copy_expert = self.copy

    @contextlib.contextmanager
    def pacing(self, pool: SlotPool, work: PendingWork) -> Iterator[None]:
        """While the block runs, route ``pool``'s copies through this pacer and hold them
        behind ``work`` (when engaged; else change nothing); afterwards the pool copies as
        before and nothing is held, even when the block raised."""
        if not self.engaged:
            yield
            return
        previous, pool.copy_expert = pool.copy_expert, self.copy
        self.track(work)
        try:
            yield
        finally:
            self.release()
            pool.copy_expert = previous

    def track(self, work: PendingWork) -> None:
        """A collective has been issued; copies from now on wait for it while it runs."""
        self._in_flight = work

    def release(self) -> None:
        """The caller has ordered itself after the tracked collective; stop holding."""
        self._in_flight = None

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy one expert's tensors (``(slot tensor, store tensor)`` pairs) in paced chunks."""
        chunks = holds = 0
        for destination, source in pairs:
            dst, src = destination.reshape(-1).view(torch.uint8), source.reshape(-1).view(torch.uint8)
            for start in range(0, src.numel(), self.chunk_bytes):
                holds += self._hold()
                end = min(start + self.chunk_bytes, src.numel())
                dst[start:end].copy_(src[start:end], non_blocking=True)
                chunks += 1
        self._stats = PacingStats(self._stats.experts + 1, self._stats.chunks + chunks, self._stats.holds + holds)

    def _hold(self) -> int:
        work = self._in_flight
        if work is None:
            return 0
        if work.is_completed():
            self._in_flight = None
            return 0
        work.wait()
        # Everything issued after this point is ordered after the collective anyway.
        self._in_flight = None
        return 1
