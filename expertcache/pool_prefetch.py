"""Prefetch: a device-mode `SlotPool` of one layer loads the experts a predictor expects,
on its copy stream, while the current stream runs something else::

    check_prefetch    refuse what prefetch refuses, changing nothing
    prefetch          copy stream waits for the current one; admit, copy there (no slot ids),
                      counted apart (the ``prefetched`` row: `SlotPool.prefetch_stats`)
    finish_prefetch   current stream waits for those copies (the layer's next call does it itself)

The admission and the copy are the kernels a call launches (``admit``, ``copy_with_kernel``),
atomic like a call (`expertcache.device_rollback`); the copy stream is joined by
`expertcache.device_streams`. The functions taking ``pool`` first are `SlotPool`'s methods
of the same names.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from expertcache.call_guards import deferred_interrupts
from expertcache.device_rollback import undone_on_error
from expertcache.device_streams import join_copies, on_stream
from expertcache.kernels._launch import on_device
from expertcache.kernels.admission import admit
from expertcache.mover import copy_with_kernel
from expertcache.pool_layers import PoolLayer, check_attached
from expertcache.validation import check_topk_ids, is_dense

if TYPE_CHECKING:
    from expertcache.slot_pool import SlotPool


def prefetch(pool: SlotPool, layer: PoolLayer, expert_ids: torch.Tensor) -> None:
    """Start loading experts a predictor expects ``layer`` to need (device mode).

    Args:
        layer: an attached layer, the only one of this pool.
        expert_ids: ``[N]`` or ``[T, K]`` int32/int64 global ids on the pool's device, at
            most ``num_slots`` of them, duplicates and -1 included (ids outside
            ``[0, E_global)`` and other ranks' experts are skipped; the first count in
            ``prefetch_stats.invalid_ids``). Leave it unchanged until the layer's next call.

    Admission and copies run on the pool's copy stream, after what the current stream
    holds, and the call returns at once: the copies overlap whatever the current stream
    runs next (another layer's compute). The pool's next ``prepare`` or ``passes`` waits
    for them (inside a CUDA graph: call it before the capture ends). Like a call, a
    prefetch may overwrite the slots of the pool's last result: enqueue the kernels that
    read it first. Prefetched experts count as used now for LRU; the counts go to
    `prefetch_stats`, not `stats`.

    Raises:
        TypeError / ValueError: ids of the wrong type, dtype, shape or device, more ids
            than slots.
        ValueError: host mode, a pool shared by several layers (its copies could overwrite
            slots another layer's kernels are reading).
        RuntimeError: an overlapped call of this pool still owes its misses pass (its
            slots are promised), or under ``torch.compile`` (a side stream).
        In every case the pool is left as it was.
    """
    expert_ids = pool.check_prefetch(layer, expert_ids)
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "prefetch enqueues on a side stream and cannot be compiled; call it outside the compiled region"
        )
    _admit_ahead(pool, layer, expert_ids)
    pool._started = True


def finish_prefetch(pool: SlotPool, layer: PoolLayer) -> None:
    """Make the current stream wait for the copies ``layer``'s prefetches still run on the
    pool's copy stream (a no-op when none does, and in host mode).

    The layer's next call joins them by itself; call this when that call lies outside
    the CUDA graph being captured (a prefetch for the next step's graph), which must
    join its side streams before the capture ends. Capturable; syncs nothing.
    """
    check_attached(pool, layer)
    with pool.guard:
        join_copies(pool)


def check_prefetch(pool: SlotPool, layer: PoolLayer, expert_ids: torch.Tensor) -> torch.Tensor:
    """Raise as `prefetch` would for ``expert_ids``, changing nothing; return them as ``[1, N]``.

    A caller that prefetches for several layers in one step (`DecodeStack`) checks them
    all before the first layer runs.
    """
    check_attached(pool, layer)
    if pool.mode != "device":
        raise ValueError("prefetch needs mode='device' (host mode plans on the host: it would sync)")
    if len(pool.layers) != 1:
        raise ValueError(
            f"prefetch needs a pool of one layer; this one serves {len(pool.layers)}, and a prefetch "
            "could overwrite slots another layer's kernels are still reading"
        )
    if isinstance(expert_ids, torch.Tensor) and is_dense(expert_ids):
        if expert_ids.dim() not in (1, 2):
            raise ValueError(f"expert_ids must be 1-D [N] or 2-D [T, K] ids, got shape {tuple(expert_ids.shape)}")
        expert_ids = expert_ids.reshape(1, -1)
    check_topk_ids(expert_ids, pool.device, name="expert_ids")
    if expert_ids.numel() > pool.num_slots:
        raise ValueError(f"prefetch at most num_slots={pool.num_slots} ids at once, got {expert_ids.numel()}")
    if pool.passes_owed:
        raise RuntimeError(
            "an overlapped call of this pool has yet to yield a pass whose slots a prefetch could "
            "overwrite: take its passes (or close its generator) first"
        )
    return expert_ids.reshape(1, -1).contiguous()


def _admit_ahead(pool: SlotPool, layer: PoolLayer, expert_ids: torch.Tensor) -> None:
    """Admit ``expert_ids`` ``[1, N]`` and copy the misses on the pool's copy stream,
    counting into the layer's ``prefetched`` row. Atomic like a call: a failing launch puts
    the slots and the state back."""
    copy_stream = pool.copy_stream()
    tables = dataclasses.replace(pool.tables, counters=pool.tables.prefetched)
    named = dict(pool.tensors)
    where: dict[str, Any] = dict(num_global=layer.num_global, key_offset=layer.key_offset)
    with pool.guard, on_device(pool.device), deferred_interrupts():
        pool.calls_begun += 1
        join_copies(pool)  # an earlier prefetch's admission lands before this one's snapshot
        with undone_on_error(pool, pool.tables, named, copy_stream), on_stream(copy_stream):
            out = torch.empty_like(expert_ids)  # the slot ids nobody reads
            admit(tables, expert_ids, layer.global_to_local, out, layer=layer.index, **where)
            copy_with_kernel(named, layer.store, tables.plan, layer.copy_groups)
        if copy_stream is not None:  # the copy stream reads them later: keep them alive until it is joined
            pool.copies_pending, pool.copy_inputs = True, (expert_ids, out)
