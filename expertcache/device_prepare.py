"""Device mode's ``prepare``: the LRU admission kernel plans and commits, the copy kernel moves.

No host sync and fixed shapes, so the call can be captured in a CUDA graph (an eager
prefill is the exception, below)::

    admission kernel   ids -> keys, hits, victims (LRU), tables updated, plan, slot ids
    copy kernel        the plan's experts, every registered tensor, host -> slots

Both launches are one ``torch.library`` custom op, ``expertcache::prepare_on_device``, with
a fake implementation and its mutations declared (the pool's state buffer and its slot
tensors), so ``torch.compile(fullgraph=True)`` of a layer calling ``provider.prepare``
traces without a graph break. Outside a capture the op snapshots the state buffer first
(one device copy); if a launch raises it puts back the slots the admission planned to
overwrite and then the state (this path reads the plan on the host), so a failed call
changes nothing.

A ``prepare`` of more ids than the pool's share (its slots, for one layer;
`expertcache.layer_shares`) could need more distinct experts than a call may hold: eagerly
it is checked on the host first (one sync), raising like host mode; inside a CUDA graph
such a call is refused (the kernel alone would only flag it, in ``stats.overflows``).
``passes`` serves any call (without a sync but for an eager prefill, below):
`expertcache.passes.max_passes` passes, fixed by the call's shape; the first one also
assigns every position its pass on the device (`expertcache.kernels.passes`), each is one
op as above, and the passes a call does not need are empty (launches only)::

    pass 0      assign passes, admit pass 0, copy      -> slot ids of pass 0, -1 elsewhere
    pass g > 0  admit pass g, copy                     -> slot ids of pass g, -1 elsewhere

An eager prefill (more than `expertcache.passes.OVERLAP_MAX_IDS` ids, served one pass after
the other, that may need more experts than the share) on a pool whose ``mover`` is
``"engine"`` (the default) reads each pass's plan back after its admission (one sync a
pass) and copies with the copy engine, which reads pinned memory faster than the copy
kernel (benchmarks/README.md, runs 51-52). The decisions are the same. Smaller calls,
overlapped passes, prefetches and anything inside a CUDA graph or ``torch.compile`` copy
with the kernel.

``passes(..., overlap=True)`` (the caller sums passes exactly) on a pool smaller than the
layer overlaps copies with compute. A call that needs several passes takes groups of half
the share (`expertcache.passes`); a call that fits is one pass. Every admission and copy of
the call runs on the pool's copy stream, in pass order; the current stream waits on events,
and pass 0 is served as its hits, then its misses, so the hits' compute hides its copies::

    enqueue pass g    copy stream waits for the current one (the apply of pass g - 2);
                      admit pass g (pass 0: hits and misses written apart), copy
    pass 0, hits      current stream waits for pass 0's admission -> hits' slot ids, -1 elsewhere
    pass 0, misses    current stream waits for pass 0's copies    -> misses' slot ids
    pass g > 0        current stream waits for pass g's copies    -> slot ids of pass g

Pass g + 1 is enqueued just before pass g is yielded (passes 0 and 1 together), so its
copies run while pass g computes.

With ``landing=True`` (a caller whose kernel waits on `expertcache.result.Landing`
counters, as `expertcache.kernels.moe_apply_passes` does) the admission also zeroes a
counter per slot and the copy kernel counts each expert's chunks into it
(`expertcache.kernels.landing`); the current stream then waits for each pass's admission,
not its copies, and the pass comes with its counters, so its kernel starts on each expert
as it lands. Only inside a CUDA graph capture where the copy kernel is launched while the
admission runs (sm_90+ with `expertcache.kernels._launch.PROGRAMMATIC_LAUNCH` on), and under
the interpreter; elsewhere (eager GPU calls included), and for decoded (coded) stores, the
passes come as without it (no counters).

``prefetch(ids)`` admits and copies predicted experts on the pool's copy stream (counted
apart, in the ``prefetched`` counters); the pool's next call joins that stream first::

    prefetch    copy stream waits for the current one; admit, copy there   (no slot ids)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from expertcache.call_guards import deferred_interrupts
from expertcache.call_plan import Load
from expertcache.errors import CacheCapacityError
from expertcache.host_prepare import local_keys
from expertcache.kernels._launch import chains_launches, on_device
from expertcache.kernels.admission import admit
from expertcache.kernels.landing import Counting
from expertcache.kernels.passes import assign_passes
from expertcache.kernels.slot_tables import SlotTables
from expertcache.mover import copy_with_engine, copy_with_kernel, landing_counting, restore_slots
from expertcache.passes import OVERLAP_MAX_IDS, max_passes
from expertcache.policies import EvictionPolicy
from expertcache.result import Landing

if TYPE_CHECKING:
    from expertcache.slot_pool import PoolLayer, SlotPool

#: The only eviction policy the device kernel implements.
DEVICE_POLICIES = ("lru",)

_POOLS: weakref.WeakValueDictionary[int, SlotPool] = weakref.WeakValueDictionary()
_IDS = itertools.count()


def check_device_policy(policy: str | EvictionPolicy) -> None:
    """Check a device-mode policy setting (the kernel is LRU; there is no policy object)."""
    if isinstance(policy, EvictionPolicy):
        raise TypeError(
            "device mode decides on the GPU with its own LRU and cannot drive a policy object; "
            "pass policy='lru' or use mode='host'"
        )
    if not isinstance(policy, str) or policy.lower() not in DEVICE_POLICIES:
        raise ValueError(f"device mode implements only {DEVICE_POLICIES}, got policy={policy!r}")


def register(pool: SlotPool) -> int:
    """A number naming ``pool`` inside the custom op (ops take tensors and ints, not objects)."""
    number = next(_IDS)
    _POOLS[number] = pool
    return number


def prepare(pool: SlotPool, layer: PoolLayer, topk_ids: torch.Tensor) -> torch.Tensor:
    """Device-mode ``SlotPool.prepare`` (see the module docstring)."""
    if min(topk_ids.numel(), layer.num_experts) > pool.share:
        if torch.compiler.is_compiling():
            raise ValueError(
                f"under torch.compile a device-mode call may hold at most {_capacity(pool)} ids (got "
                f"{topk_ids.numel()}): a larger call is checked on the host, which a compiled graph cannot do"
            )
        if _capturing(pool):
            raise ValueError(
                f"a CUDA graph can hold a call of at most {_capacity(pool)} ids (got "
                f"{topk_ids.numel()}): only then can it never need more experts than it may hold"
            )
        keys = local_keys(layer, topk_ids.cpu().numpy())  # prefill: a sync is cheap here
        if len(keys) > pool.share:
            raise CacheCapacityError(len(keys), pool.share, layers=len(pool.layers))
    return _run(pool, layer, topk_ids.contiguous(), pool.no_passes, 0)


def passes(
    pool: SlotPool, layer: PoolLayer, topk_ids: torch.Tensor, overlap: bool = False, landing: bool = False
) -> Generator[tuple[torch.Tensor, Landing | None]]:
    """Device-mode ``SlotPool.passes``: slot ids of each pass, and the landing counters the
    caller's kernel waits on (only for an overlapped call with ``landing``; see the module
    docstring)."""
    overlap = overlap and not torch.compiler.is_compiling()  # a traced op runs on no side stream
    count = max_passes(topk_ids.numel(), layer.num_experts, pool.share, overlap=overlap)
    if overlap and pool.share < layer.num_experts:  # else nothing is missed once warm: one pass
        counting = landing_counting(layer.copy_groups) if landing and _lands_apart(pool) else None
        yield from _overlapped_passes(pool, layer, topk_ids.contiguous(), count, counting)
        return
    if count == 1:
        yield prepare(pool, layer, topk_ids), None
        return
    ids = topk_ids.contiguous()
    with torch.inference_mode(False):
        pass_of = torch.empty(ids.shape, dtype=torch.int32, device=pool.device)
    for index in range(count):
        yield _run(pool, layer, ids, pass_of, index), None


def _lands_apart(pool: SlotPool) -> bool:
    """Whether an apply may wait on landing counts on this pool's device: under the
    interpreter (programs run in order), or inside a CUDA graph capture where the copy kernel
    is launched while the admission runs (a programmatic edge) and the graph keeps the copy
    stream's priority per node (PyTorch instantiates graphs with node priorities), so the
    copy kernel holds its SMs before any apply waits on it. Eager GPU calls wait for copies."""
    return pool.device.type != "cuda" or (chains_launches(pool.device) and _capturing(pool))


def _run(pool: SlotPool, layer: PoolLayer, ids: torch.Tensor, pass_of: torch.Tensor, index: int) -> torch.Tensor:
    # torch.compile sees the custom op; eagerly the implementation runs directly (the
    # dispatcher costs ~10 us a call), and a prefill may take the copy engine (`_by_engine`).
    if torch.compiler.is_compiling():
        return torch.ops.expertcache.prepare_on_device(
            ids, pool.tables.buffer, list(pool.tensors.values()), pool.op_id, layer.index, pass_of, index
        )
    tables, named = pool.tables, dict(pool.tensors)
    return _admit_and_move(pool, layer, tables, named, ids, pass_of, index, engine=_by_engine(pool, layer, ids))


def _by_engine(pool: SlotPool, layer: PoolLayer, ids: torch.Tensor) -> bool:
    """Whether this eager call reads each pass's plan on the host and copies with the engine:
    a prefill (more than `OVERLAP_MAX_IDS` ids, the line `DecodeStack` draws) that could
    need more experts than the share, on a pool whose mover is the engine."""
    prefill = ids.numel() > OVERLAP_MAX_IDS and min(ids.numel(), layer.num_experts) > pool.share
    return pool.mover == "engine" and prefill and not _capturing(pool)


def _capturing(pool: SlotPool) -> bool:
    """Whether the pool's device's current stream is capturing a CUDA graph."""
    if pool.device.type != "cuda":
        return False
    with torch.cuda.device(pool.device):
        return torch.cuda.is_current_stream_capturing()


def _capacity(pool: SlotPool) -> str:
    return f"num_slots={pool.num_slots}" if len(pool.layers) == 1 else f"share={pool.share} (num_slots // layers)"


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


def _overlapped_passes(
    pool: SlotPool, layer: PoolLayer, ids: torch.Tensor, count: int, counting: Counting | None
) -> Iterator[tuple[torch.Tensor, Landing | None]]:
    """``count`` passes (one for a call that fits), pass 0 split into its hits and its
    misses, every admission and copy on the pool's copy stream in pass order. Pass g's
    results are yielded once the current stream waits for its admission (hits, or with
    landing counts, ``counting`` not None) or its copies; pass g + 1 is enqueued before pass
    g is yielded, after the caller's kernels of pass g - 1: the slots it overwrites are only
    ever those of passes before g."""
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
        with _on_stream(copy_stream), _undone_on_error(pool, pool.tables, named, None):
            if passes is not None and index == 0:
                assign_passes(pool.tables, ids, layer.global_to_local, passes, overlap=True, **where)
            admit(
                pool.tables, ids, layer.global_to_local, out, layer=layer.index, passes=passes, pass_index=index,
                miss_out=misses, key_layer=pool.key_layer, landed=landed,
                landed_target=0 if counting is None else counting.target, **where,
            )  # fmt: skip
            admitted = _recorded(copy_stream) if split or landed is not None else None
            copy_with_kernel(named, layer.store, pool.tables.plan, layer.copy_groups, landed)
            copied = _recorded(copy_stream)
    landing = None
    if landed is not None and counting is not None:
        landing = Landing(landed, counting.target, counting.gate_up_target, counting.gate_up_mask)
    return _Enqueued(out, misses, landing, admitted, copied)


def _recorded(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def prefetch(pool: SlotPool, layer: PoolLayer, expert_ids: torch.Tensor) -> None:
    """Device-mode ``SlotPool.prefetch``: admit ``expert_ids`` ``[1, N]`` and copy the misses
    on the pool's copy stream, counting into the layer's ``prefetched`` row. Atomic like a
    call: a failing launch puts the slots and the state back."""
    copy_stream = pool.copy_stream()
    tables = dataclasses.replace(pool.tables, counters=pool.tables.prefetched)
    named = dict(pool.tensors)
    where: dict[str, Any] = dict(num_global=layer.num_global, key_offset=layer.key_offset)
    with pool.guard, on_device(pool.device), deferred_interrupts():
        pool.calls_begun += 1
        join_copies(pool)  # an earlier prefetch's admission lands before this one's snapshot
        with _undone_on_error(pool, pool.tables, named, copy_stream), _on_stream(copy_stream):
            out = torch.empty_like(expert_ids)  # the slot ids nobody reads
            admit(tables, expert_ids, layer.global_to_local, out, layer=layer.index, **where)
            copy_with_kernel(named, layer.store, tables.plan, layer.copy_groups)
        if copy_stream is not None:  # the copy stream reads them later: keep them alive until it is joined
            pool.copies_pending, pool.copy_inputs = True, (expert_ids, out)


def _prepare_op(
    topk_ids: torch.Tensor,
    state: torch.Tensor,
    slots: list[torch.Tensor],
    pool: int,
    layer: int,
    pass_of: torch.Tensor,
    pass_index: int,
) -> torch.Tensor:
    """The custom op's implementation: `_admit_and_move` with the copy kernel."""
    owner = _POOLS[pool]
    tables = owner.tables if state.data_ptr() == owner.tables.buffer.data_ptr() else _view_like(owner.tables, state)
    named = dict(zip(owner.tensors, slots, strict=True))
    return _admit_and_move(owner, owner.ordered_layers[layer], tables, named, topk_ids, pass_of, pass_index)


def _admit_and_move(
    pool: SlotPool,
    layer: PoolLayer,
    tables: SlotTables,
    slots: dict[str, torch.Tensor],
    topk_ids: torch.Tensor,
    pass_of: torch.Tensor,
    pass_index: int,
    engine: bool = False,
) -> torch.Tensor:
    """One call (``pass_of`` empty) or one pass of a call on the current stream: admission,
    then the plan's copies, by the copy kernel or (``engine``: the plan read on the host,
    one sync) by the copy engine. Returns the slot ids, ``topk_ids``' shape, int32."""
    out = torch.empty_like(topk_ids)
    passes = pass_of if pass_of.numel() else None
    where: dict[str, Any] = dict(num_global=layer.num_global, key_offset=layer.key_offset)
    with pool.guard, on_device(pool.device), deferred_interrupts():
        pool.calls_begun += 1  # an overlapped call suspended between its passes now refuses to go on
        join_copies(pool)
        pool.passes_owed = False  # a new call ends what an earlier one's slots held
        with _undone_on_error(pool, tables, slots, None):
            if passes is not None and pass_index == 0:
                assign_passes(tables, topk_ids, layer.global_to_local, passes, **where)
            admit(
                tables, topk_ids, layer.global_to_local, out, layer=layer.index, passes=passes, pass_index=pass_index,
                key_layer=pool.key_layer, **where,
            )  # fmt: skip
            if engine:
                loads = _planned_loads(tables)
                copy_with_engine(
                    slots, layer.store, loads, layer.key_offset, pool.copy_expert, tables.plan, layer.copy_groups
                )
            else:
                copy_with_kernel(slots, layer.store, tables.plan, layer.copy_groups)
    return out


@contextlib.contextmanager
def _undone_on_error(
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


def _on_stream(stream: torch.cuda.Stream | None):
    """Enqueue on ``stream`` after what the current stream holds (a no-op for None)."""
    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    return torch.cuda.stream(stream)


_op = torch.library.custom_op("expertcache::prepare_on_device", _prepare_op, mutates_args=("state", "slots", "pass_of"))


@_op.register_fake
def _(topk_ids, state, slots, pool, layer, pass_of, pass_index) -> torch.Tensor:
    return torch.empty_like(topk_ids)


def _snapshot(pool: SlotPool, state: torch.Tensor) -> torch.Tensor | None:
    """A copy of the state to roll back to; none inside a capture (nothing runs until replay)."""
    if _capturing(pool):
        return None
    if pool.backup is None or pool.backup.shape != state.shape:
        with torch.inference_mode(False):
            pool.backup = torch.empty_like(state)
    return pool.backup.copy_(state)


def _roll_back(pool: SlotPool, tables: SlotTables, slots: dict[str, torch.Tensor], backup: torch.Tensor) -> None:
    """Undo a call that failed after admission ran: its slots, then its tables (syncs)."""
    if torch.equal(tables.buffer, backup):
        return  # the admission never ran: nothing to undo
    restore_slots(slots, _planned_loads(tables), pool.store_of)
    tables.buffer.copy_(backup)


def _planned_loads(tables: SlotTables) -> list[Load]:
    """The plan's loads, read on the host (one sync)."""
    entries = tables.plan_on_host().tolist()
    return [Load(key, slot, None if evicted < 0 else evicted) for _, slot, key, evicted in entries]


def _view_like(tables: SlotTables, buffer: torch.Tensor) -> SlotTables:
    return SlotTables.view(buffer, tables.num_keys, tables.num_slots, tables.num_layers)
