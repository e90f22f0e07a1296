"""Device mode's overlapped passes: each pass's copies run while the pass before computes.

``passes(..., overlap=True)`` (the caller sums passes exactly) on a pool smaller than the
layer overlaps copies with compute (`expertcache.device_prepare.passes` sends it here). A
call that needs several passes takes groups of half the share (`expertcache.passes`); a
call that fits is one pass. Every admission and copy of the call runs on the pool's copy
stream (`expertcache.device_streams`), in pass order; the current stream waits on events,
and pass 0 is served as its hits, then its misses, so the hits' compute hides its copies::

    enqueue pass g    copy stream waits for the current one (the apply of pass g - 2);
                      admit pass g (pass 0: hits and misses written apart), copy
    pass 0, hits      current stream waits for pass 0's admission -> hits' slot ids, -1 elsewhere
    pass 0, misses    current stream waits for pass 0's copies    -> misses' slot ids
    pass g > 0        current stream waits for pass g's copies    -> slot ids of pass g

Pass g + 1 is enqueued just before pass g is yielded (passes 0 and 1 together), so its
copies run while pass g computes. Each enqueued pass is atomic like a call
(`expertcache.device_rollback`). Another call on the pool between two passes makes the
call refuse to go on: it may have taken the slots of the pass admitted ahead.

With ``landing=True`` (a caller whose kernel waits on `expertcache.result.Landing`
counters, as `expertcache.kernels.moe_apply_passes` does) the admission also zeroes a
counter per slot and the copy kernel counts each expert's chunks into it
(`expertcache.kernels.landing`); the current stream then waits for each pass's admission,
not its copies, and the pass comes with its counters, so its kernel starts on each expert
as it lands. Only inside a CUDA graph capture where the copy kernel is launched while the
admission runs (sm_90+ with `expertcache.kernels._launch.PROGRAMMATIC_LAUNCH` on), and under
the interpreter; elsewhere (eager GPU calls included), and for decoded (coded) stores, the
passes come as without it (no counters).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from expertcache.call_guards import deferred_interrupts
from expertcache.device_rollback import undone_on_error
from expertcache.device_streams import capturing, join_copies, on_stream, recorded
from expertcache.kernels._launch import chains_launches, on_device
from expertcache.kernels.admission import admit
from expertcache.kernels.landing import Counting
from expertcache.kernels.passes import assign_passes
from expertcache.mover import copy_with_kernel, landing_counting
from expertcache.result import Landing

if TYPE_CHECKING:
    from expertcache.pool_layers import PoolLayer
    from expertcache.slot_pool import SlotPool


class _Enqueued(NamedTuple):
    """One overlapped pass on the copy stream: its slot ids (hits only for a split pass),
    the misses' slot ids of a split pass, its landing counters (or None), and the events
    after its admission and copies (None without a copy stream: then all of it ran on the
    current stream)."""

    slot_ids: torch.Tensor
    miss_slot_ids: torch.Tensor | None
    landing: Landing | None
    admitted: torch.cuda.Event | None
    copied: torch.cuda.Event | None

    @property
    def ready(self) -> torch.cuda.Event | None:
        """What the current stream waits for before the pass's copied slots are read: the
        admission when a kernel waits on the landing counters, else the copies."""
        return self.admitted if self.landing is not None else self.copied


def overlapped_passes(
    pool: SlotPool, layer: PoolLayer, ids: torch.Tensor, count: int, landing: bool
) -> Iterator[tuple[torch.Tensor, Landing | None]]:
    """``count`` passes (one for a call that fits), pass 0 split into its hits and its
    misses, every admission and copy on the pool's copy stream in pass order. Pass g's
    results are yielded once the current stream waits for its admission (hits, or with
    landing counts where the device allows them: `_lands_apart`) or its copies; pass g + 1
    is enqueued before pass g is yielded, after the caller's kernels of pass g - 1: the
    slots it overwrites are only ever those of passes before g."""
    counting = landing_counting(layer.copy_groups) if landing and _lands_apart(pool) else None
    pass_of = pool.no_passes
    if count > 1:
        with torch.inference_mode(False):
            pass_of = torch.empty(ids.shape, dtype=torch.int32, device=pool.device)
    main = torch.cuda.current_stream(pool.device) if pool.copy_stream() is not None else None
    begun: list[int] = []  # the call's number (`SlotPool.calls_begun`), once it is inside the pool
    enqueued: list[_Enqueued] = []  # their counters live until the copy stream is joined

    def enqueue(index: int, split: bool = False) -> _Enqueued:
        starts = begun if index == 0 else None
        enqueued.append(_enqueue_pass(pool, layer, ids, pass_of, index, counting, split, starts))
        return enqueued[-1]

    try:
        first = enqueue(0, split=True)
        following = enqueue(1) if count > 1 else None
        pool.passes_owed = True  # the misses' slots are promised: no prefetch may take them meanwhile
        _wait(main, first.admitted)
        yield first.slot_ids, None
        _check_no_call_between(pool, begun[0])
        pool.passes_owed = count > 1
        _wait(main, first.ready)
        assert first.miss_slot_ids is not None  # a split pass
        yield first.miss_slot_ids, first.landing
        for index in range(1, count):
            _check_no_call_between(pool, begun[0])
            current = following
            assert current is not None  # enqueued one pass ahead
            following = enqueue(index + 1) if index + 1 < count else None
            pool.passes_owed = following is not None
            _wait(main, current.ready)
            yield current.slot_ids, current.landing
    finally:
        if begun:  # a thread refused at the pool's guard changed nothing, and must not now
            if pool.calls_begun == begun[0]:  # a later call (still owing passes, maybe) owns the flag
                pool.passes_owed = False
            join_copies(pool)  # the caller stopped early, or the last pass: join the copy stream


def _lands_apart(pool: SlotPool) -> bool:
    """Whether an apply may wait on landing counts on this pool's device: under the
    interpreter (programs run in order), or inside a CUDA graph capture where the copy kernel
    is launched while the admission runs (a programmatic edge) and the graph keeps the copy
    stream's priority per node (PyTorch instantiates graphs with node priorities), so the
    copy kernel holds its SMs before any apply waits on it. Eager GPU calls wait for copies."""
    return pool.device.type != "cuda" or (chains_launches(pool.device) and capturing(pool))


def _check_no_call_between(pool: SlotPool, begun: int) -> None:
    """Refuse to go on with an overlapped call after another call on its pool: that call may
    have evicted the slots of the pass admitted ahead (its results would read other experts)."""
    if pool.calls_begun != begun:
        raise RuntimeError(
            "another call on this slot pool ran between the passes of an overlapped device-mode call, "
            "and may have taken the slots of the pass it had admitted ahead; take (or close) a call's "
            "passes before the next call on the pool"
        )


def _wait(main: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    if main is not None and event is not None:
        main.wait_event(event)


def _enqueue_pass(
    pool: SlotPool,
    layer: PoolLayer,
    ids: torch.Tensor,
    pass_of: torch.Tensor,
    index: int,
    counting: Counting | None,
    split: bool = False,
    starts: list[int] | None = None,
) -> _Enqueued:
    """Admit pass ``index`` of an overlapped call and copy its misses, both on the pool's
    copy stream after what the current stream holds (atomic like a call: a failure is
    undone there), counting what lands when ``counting`` is given. The outputs are allocated
    on the current stream, which reads them. ``starts``: the call begins here; once inside
    the pool's guard, the call's number is appended to it."""
    copy_stream = pool.copy_stream()
    out = torch.empty_like(ids)
    misses = torch.empty_like(ids) if split else None
    landed = None if counting is None else torch.empty(pool.num_slots, dtype=torch.int32, device=pool.device)
    named = dict(pool.tensors)
    passes = pass_of if pass_of.numel() else None
    where: dict[str, Any] = dict(num_global=layer.num_global, key_offset=layer.key_offset)
    with pool.guard, on_device(pool.device), deferred_interrupts():
        if starts is not None:  # counted inside the guard: a caller refused at it changes nothing
            pool.calls_begun += 1
            starts.append(pool.calls_begun)
        pool.copies_pending = copy_stream is not None  # from here on, the generator's end joins
        with on_stream(copy_stream), undone_on_error(pool, pool.tables, named, None):
            if passes is not None and index == 0:
                assign_passes(pool.tables, ids, layer.global_to_local, passes, overlap=True, **where)
            admit(
                pool.tables, ids, layer.global_to_local, out, layer=layer.index, passes=passes, pass_index=index,
                miss_out=misses, key_layer=pool.key_layer, landed=landed,
                landed_target=0 if counting is None else counting.target, **where,
            )  # fmt: skip
            admitted = recorded(copy_stream) if split or landed is not None else None
            copy_with_kernel(named, layer.store, pool.tables.plan, layer.copy_groups, landed)
            copied = recorded(copy_stream)
    landing = None
    if landed is not None and counting is not None:
        landing = Landing(landed, counting.target, counting.gate_up_target, counting.gate_up_mask)
    return _Enqueued(out, misses, landing, admitted, copied)
