"""Device mode's ``prepare``: the LRU admission kernel plans and commits, the copy kernel moves.

No host sync and fixed shapes, so the call can be captured in a CUDA graph::

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
``passes`` serves any call without a sync: `expertcache.passes.max_passes` passes, fixed
by the call's shape; the first one also assigns every position its pass on the device
(`expertcache.kernels.passes`), each is one op as above, and the passes a call does not
need are empty (launches only)::

    pass 0      assign passes, admit pass 0, copy      -> slot ids of pass 0, -1 elsewhere
    pass g > 0  admit pass g, copy                     -> slot ids of pass g, -1 elsewhere

``passes(..., overlap=True)`` (the caller sums passes exactly) overlaps copies with compute
on the pool's copy stream. A call that needs several passes takes groups of half the share
(`expertcache.passes`), and each pass's copies run while the previous pass computes::

    pass g      current stream joins the copies of pass g - 1; admit pass g;
                copy stream waits for the current one (the apply of pass g - 2), copies
                                                       -> slot ids of pass g (once joined)

A decode call on a pool smaller than the layer that fits in one pass is split instead, so
the hits' compute hides part of the copies::

    hits        admit (hits and misses written apart), copy on the pool's copy stream
                                                       -> hits' slot ids, -1 for misses
    misses      current stream joins the copy stream   -> misses' slot ids, -1 for hits

``prefetch(ids)`` admits and copies predicted experts on the pool's copy stream (counted
apart, in the ``prefetched`` counters); the pool's next call joins that stream first::

    prefetch    copy stream waits for the current one; admit, copy there   (no slot ids)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from expertcache.call_guards import deferred_interrupts
from expertcache.call_plan import Load
from expertcache.errors import CacheCapacityError
from expertcache.host_prepare import local_keys
from expertcache.kernels._launch import on_device
from expertcache.kernels.admission import SMALL_CALL, admit
from expertcache.kernels.passes import assign_passes
from expertcache.kernels.slot_tables import SlotTables
from expertcache.mover import copy_with_kernel, restore_slots
from expertcache.passes import max_passes
from expertcache.policies import EvictionPolicy

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
        if pool.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"a CUDA graph can hold a call of at most {_capacity(pool)} ids (got "
                f"{topk_ids.numel()}): only then can it never need more experts than it may hold"
            )
        keys = local_keys(layer, topk_ids.cpu().numpy())  # prefill: a sync is cheap here
        if len(keys) > pool.share:
            raise CacheCapacityError(len(keys), pool.share, layers=len(pool.layers))
    return _run(pool, layer, topk_ids.contiguous(), pool.no_passes, 0)


def passes(pool: SlotPool, layer: PoolLayer, topk_ids: torch.Tensor, overlap: bool = False) -> Iterator[torch.Tensor]:
    """Device-mode ``SlotPool.passes``: slot ids of each pass (see the module docstring)."""
    overlap = overlap and not torch.compiler.is_compiling()  # a traced op runs on no side stream
    count = max_passes(topk_ids.numel(), layer.num_experts, pool.share, overlap=overlap)
    if count == 1 and overlap and _splits(pool, layer, topk_ids):
        yield from _hits_then_misses(pool, layer, topk_ids.contiguous())
        return
    if count == 1:
        yield prepare(pool, layer, topk_ids)
        return
    ids = topk_ids.contiguous()
    with torch.inference_mode(False):
        pass_of = torch.empty(ids.shape, dtype=torch.int32, device=pool.device)
    if overlap:
        yield from _overlapped_passes(pool, layer, ids, pass_of, count)
        return
    for index in range(count):
        yield _run(pool, layer, ids, pass_of, index)


def _run(pool: SlotPool, layer: PoolLayer, ids: torch.Tensor, pass_of: torch.Tensor, index: int) -> torch.Tensor:
    # Eagerly the implementation runs directly (the dispatcher costs ~10 us a call);
    # torch.compile sees the custom op.
    run = torch.ops.expertcache.prepare_on_device if torch.compiler.is_compiling() else _admit_and_copy
    return run(ids, pool.tables.buffer, list(pool.tensors.values()), pool.op_id, layer.index, pass_of, index)


def _capacity(pool: SlotPool) -> str:
    return f"num_slots={pool.num_slots}" if len(pool.layers) == 1 else f"share={pool.share} (num_slots // layers)"


def _splits(pool: SlotPool, layer: PoolLayer, topk_ids: torch.Tensor) -> bool:
    """Whether a one-pass call is served as its hits, then its misses: a decode-sized call on
    a pool whose share cannot hold every expert of the layer (else nothing is missed once
    warm, and the second pass would cost launches only), outside ``torch.compile`` (streams)."""
    return topk_ids.numel() <= SMALL_CALL and pool.share < layer.num_experts and not torch.compiler.is_compiling()


def _hits_then_misses(pool: SlotPool, layer: PoolLayer, ids: torch.Tensor) -> Iterator[torch.Tensor]:
    """One call as two passes: the hits' slot ids at once, while the misses are copied on
    the pool's copy stream; the misses' slot ids once the current stream has joined it."""
    misses = torch.empty_like(ids)
    hits = _admit_and_copy(ids, pool.tables.buffer, list(pool.tensors.values()), pool.op_id, layer.index,
                           pool.no_passes, 0, misses)  # fmt: skip
    pool.copies_pending = pool.copy_stream() is not None
    pool.passes_owed = True  # their slots are promised: no prefetch may take them meanwhile
    try:
        yield hits
        pool.passes_owed = False
        join_copies(pool)  # the misses' slots are filled once the current stream has joined
        yield misses
    finally:
        pool.passes_owed = False
        join_copies(pool)  # the caller stopped early: join anyway


def _overlapped_passes(
    pool: SlotPool, layer: PoolLayer, ids: torch.Tensor, pass_of: torch.Tensor, count: int
) -> Iterator[torch.Tensor]:
    """``count`` passes, each one's copies on the pool's copy stream while the one before
    computes. Enqueueing pass g + 1 first joins the copies of pass g (so pass g's slots
    are filled before its result is used) and forks after the caller's kernels of pass
    g - 1: the slots pass g + 1 overwrites are only ever those of passes before g."""

    def enqueue(index: int) -> torch.Tensor:
        out = _admit_and_copy(ids, pool.tables.buffer, list(pool.tensors.values()), pool.op_id, layer.index,
                              pass_of, index, overlap=True)  # fmt: skip
        pool.copies_pending = pool.copy_stream() is not None
        return out

    try:
        pending = [enqueue(0)]
        for index in range(1, count + 1):
            if index < count:
                pending.append(enqueue(index))
            else:
                join_copies(pool)
            pool.passes_owed = index < count  # a pass not yet taken: its slots are promised
            yield pending.pop(0)
    finally:
        pool.passes_owed = False
        join_copies(pool)  # the caller stopped early: join anyway


def prefetch(pool: SlotPool, layer: PoolLayer, expert_ids: torch.Tensor) -> None:
    """Device-mode ``SlotPool.prefetch``: admit ``expert_ids`` ``[1, N]`` and copy the misses
    on the pool's copy stream, counting into the layer's ``prefetched`` row. Atomic like a
    call: a failing launch puts the slots and the state back."""
    copy_stream = pool.copy_stream()
    tables = dataclasses.replace(pool.tables, counters=pool.tables.prefetched)
    named = dict(pool.tensors)
    where = dict(num_global=layer.num_global, key_offset=layer.key_offset)
    with pool.guard, on_device(pool.device), deferred_interrupts():
        join_copies(pool)  # an earlier prefetch's admission lands before this one's snapshot
        with _undone_on_error(pool, pool.tables, named, copy_stream), _on_stream(copy_stream):
            out = torch.empty_like(expert_ids)  # the slot ids nobody reads
            admit(tables, expert_ids, layer.global_to_local, out, layer=layer.index, **where)
            copy_with_kernel(named, layer.store, tables.plan, layer.copy_groups)
        if copy_stream is not None:  # the copy stream reads them later: keep them alive until it is joined
            pool.copies_pending, pool.copy_inputs = True, (expert_ids, out)


def _admit_and_copy(
    topk_ids: torch.Tensor,
    state: torch.Tensor,
    slots: list[torch.Tensor],
    pool: int,
    layer: int,
    pass_of: torch.Tensor,
    pass_index: int,
    misses: torch.Tensor | None = None,
    overlap: bool = False,
) -> torch.Tensor:
    """One call (``pass_of`` empty) or one pass of a call: admission, then copies. With
    ``misses`` (a split call) the returned slot ids are the hits', ``misses`` receives the
    misses'; with ``overlap`` the call's passes are overlapped passes. In both cases the
    copies run on the pool's copy stream after the admission (the caller joins it)."""
    owner = _POOLS[pool]
    copy_stream = owner.copy_stream() if misses is not None or overlap else None
    entry = owner.ordered_layers[layer]
    tables = owner.tables if state.data_ptr() == owner.tables.buffer.data_ptr() else _view_like(owner.tables, state)
    out = torch.empty_like(topk_ids)
    named = dict(zip(owner.tensors, slots, strict=True))
    passes = pass_of if pass_of.numel() else None
    where = dict(num_global=entry.num_global, key_offset=entry.key_offset)
    with owner.guard, on_device(owner.device), deferred_interrupts():
        join_copies(owner)
        owner.passes_owed = False  # a new call ends what an earlier one's slots held
        with _undone_on_error(owner, tables, named, copy_stream):
            if passes is not None and pass_index == 0:
                assign_passes(tables, topk_ids, entry.global_to_local, passes, overlap=overlap, **where)
            admit(
                tables, topk_ids, entry.global_to_local, out, layer=entry.index, passes=passes, pass_index=pass_index,
                miss_out=misses, key_layer=owner.key_layer, **where,
            )  # fmt: skip
            with _on_stream(copy_stream):
                copy_with_kernel(named, entry.store, tables.plan, entry.copy_groups)
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


def _call_or_pass(
    topk_ids: torch.Tensor,
    state: torch.Tensor,
    slots: list[torch.Tensor],
    pool: int,
    layer: int,
    pass_of: torch.Tensor,
    pass_index: int,
) -> torch.Tensor:
    """`_admit_and_copy` without ``misses``: what ``torch.compile`` sees (it never overlaps).
    An optional mutated ``misses`` in the op's schema broke fake-tensor tracing on torch 2.11
    (IndexError inside Dynamo), so the op keeps the schema it had before overlap existed."""
    return _admit_and_copy(topk_ids, state, slots, pool, layer, pass_of, pass_index)


_op = torch.library.custom_op(
    "expertcache::prepare_on_device", _call_or_pass, mutates_args=("state", "slots", "pass_of")
)


@_op.register_fake
def _(topk_ids, state, slots, pool, layer, pass_of, pass_index) -> torch.Tensor:
    return torch.empty_like(topk_ids)


def _snapshot(pool: SlotPool, state: torch.Tensor) -> torch.Tensor | None:
    """A copy of the state to roll back to; none inside a capture (nothing runs until replay)."""
    if pool.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if pool.backup is None or pool.backup.shape != state.shape:
        with torch.inference_mode(False):
            pool.backup = torch.empty_like(state)
    return pool.backup.copy_(state)


def _roll_back(pool: SlotPool, tables: SlotTables, slots: dict[str, torch.Tensor], backup: torch.Tensor) -> None:
    """Undo a call that failed after admission ran: its slots, then its tables (syncs)."""
    if torch.equal(tables.buffer, backup):
        return  # the admission never ran: nothing to undo
    count = int(tables.plan[0])
    loads = [
        Load(key, slot, None if evicted < 0 else evicted)
        for _, slot, key, evicted in tables.plan_entries()[:count].tolist()
    ]
    restore_slots(slots, loads, pool.store_of)
    tables.buffer.copy_(backup)


def _view_like(tables: SlotTables, buffer: torch.Tensor) -> SlotTables:
    return SlotTables.view(buffer, tables.num_keys, tables.num_slots, tables.num_layers)
