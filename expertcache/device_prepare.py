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

``passes(..., overlap=True)`` on a pool smaller than the layer overlaps each pass's copies
with the compute of the pass before, on the pool's copy stream (`expertcache.device_overlap`);
``prefetch`` admits and copies predicted experts there too (`expertcache.pool_prefetch`).
Each of them launches the same kernels (``admit``, ``copy_with_kernel``, imported by each
module that launches them), atomic by `expertcache.device_rollback`; the copy stream is
joined by `expertcache.device_streams`.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import torch

from expertcache.call_guards import deferred_interrupts
from expertcache.device_overlap import overlapped_passes
from expertcache.device_rollback import planned_loads, undone_on_error
from expertcache.device_streams import capturing, join_copies
from expertcache.errors import CacheCapacityError
from expertcache.host_prepare import local_keys
from expertcache.kernels._launch import on_device
from expertcache.kernels.admission import admit
from expertcache.kernels.passes import assign_passes
from expertcache.kernels.slot_tables import SlotTables
from expertcache.mover import copy_with_engine, copy_with_kernel
from expertcache.passes import OVERLAP_MAX_IDS, max_passes
from expertcache.policies import EvictionPolicy
from expertcache.result import Landing

if TYPE_CHECKING:
    from expertcache.pool_layers import PoolLayer
    from expertcache.slot_pool import SlotPool

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
        if capturing(pool):
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
        yield from overlapped_passes(pool, layer, topk_ids.contiguous(), count, landing)
        return
    if count == 1:
        yield prepare(pool, layer, topk_ids), None
        return
    ids = topk_ids.contiguous()
    with torch.inference_mode(False):
        pass_of = torch.empty(ids.shape, dtype=torch.int32, device=pool.device)
    for index in range(count):
        yield _run(pool, layer, ids, pass_of, index), None


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
    return pool.mover == "engine" and prefill and not capturing(pool)


def _capacity(pool: SlotPool) -> str:
    return f"num_slots={pool.num_slots}" if len(pool.layers) == 1 else f"share={pool.share} (num_slots // layers)"


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
        with undone_on_error(pool, tables, slots, None):
            if passes is not None and pass_index == 0:
                assign_passes(tables, topk_ids, layer.global_to_local, passes, **where)
            admit(
                tables, topk_ids, layer.global_to_local, out, layer=layer.index, passes=passes, pass_index=pass_index,
                key_layer=pool.key_layer, **where,
            )  # fmt: skip
            if engine:
                loads = planned_loads(tables)
                copy_with_engine(
                    slots, layer.store, loads, layer.key_offset, pool.copy_expert, tables.plan, layer.copy_groups
                )
            else:
                copy_with_kernel(slots, layer.store, tables.plan, layer.copy_groups)
    return out


_op = torch.library.custom_op("expertcache::prepare_on_device", _prepare_op, mutates_args=("state", "slots", "pass_of"))


@_op.register_fake
def _(topk_ids, state, slots, pool, layer, pass_of, pass_index) -> torch.Tensor:
    return torch.empty_like(topk_ids)


def _view_like(tables: SlotTables, buffer: torch.Tensor) -> SlotTables:
    return SlotTables.view(buffer, tables.num_keys, tables.num_slots, tables.num_layers)
