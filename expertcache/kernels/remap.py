"""Remap: router expert ids -> slot ids through one int32 table, and the lookup every kernel shares.

``out[i] = mapping[topk_ids[i]]``; an id of -1 (or any id outside the table) gives -1. The
table composes the EP ``expert_map`` (global -> local, -1 = another rank's) with expert ->
slot, so one gather gives slot ids and the fused kernel's "skip -1" logic works unchanged.
Pure indexing with no control flow on values: it replays inside a CUDA graph.

`lookup_slots` is the one place where a cache kernel turns ids into slots: the admission
kernel (device mode), the commit kernel (host mode) and this remap all call it. Ids are
range-checked in their own dtype before any narrowing, so an int64 id of ``2**32 + 3`` is
out of range, not expert 3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import on_device, runs_on
from expertcache.validation import is_dense, layout_name

_BLOCK = 1024
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def lookup_slots(
    ids_ptr, positions, in_bounds, global_to_local_ptr, table_ptr, num_global, key_offset, HAS_MAP: tl.constexpr
):
    """For a block of ids: ``(local expert, key, is_local, invalid, slot)``.

    ``invalid`` marks ids outside ``[0, num_global)``; ``slot`` is ``table[key]`` for local
    ids and -1 otherwise (nothing outside the tables is read).
    """
    ids = tl.load(ids_ptr + positions, mask=in_bounds, other=-1)
    valid = in_bounds & (ids >= 0) & (ids < num_global)
    safe = tl.where(valid, ids, 0).to(tl.int32)
    if HAS_MAP:
        local = tl.load(global_to_local_ptr + safe, mask=valid, other=-1)
    else:
        local = tl.where(valid, safe, -1)
    is_local = valid & (local >= 0)
    key = local + key_offset
    slot = tl.load(table_ptr + key, mask=is_local, other=-1)
    return local, key, is_local, in_bounds & ~valid, slot


@triton.jit
def _remap_kernel(ids_ptr, mapping_ptr, out_ptr, num_ids, num_entries, BLOCK: tl.constexpr):
    positions = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = positions < num_ids
    _, _, _, _, mapped = lookup_slots(ids_ptr, positions, in_bounds, mapping_ptr, mapping_ptr, num_entries, 0, False)
    tl.store(out_ptr + positions, mapped.to(out_ptr.dtype.element_ty), mask=in_bounds)


def remap_topk_ids_torch(topk_ids: torch.Tensor, mapping: torch.Tensor) -> torch.Tensor:
    """Reference: ``mapping[topk_ids]`` with -1 (and any id outside the table) giving -1."""
    valid = (topk_ids >= 0) & (topk_ids < mapping.numel())
    mapped = mapping.to(topk_ids.dtype)[torch.where(valid, topk_ids, 0)]
    return torch.where(valid, mapped, torch.full_like(topk_ids, -1))


def launch_remap(topk_ids: torch.Tensor, mapping: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``mapping[topk_ids]`` into ``out`` (checked by `remap_topk_ids`); torch on a plain CPU."""
    if not runs_on(topk_ids):
        out.copy_(remap_topk_ids_torch(topk_ids, mapping))
        return
    ids = topk_ids.contiguous()
    if ids.numel():
        with on_device(ids.device):
            grid = (triton.cdiv(ids.numel(), _BLOCK),)
            _remap_kernel[grid](ids, mapping.contiguous(), out, ids.numel(), mapping.numel(), BLOCK=_BLOCK)


def _remap(topk_ids: torch.Tensor, mapping: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(topk_ids, memory_format=torch.contiguous_format)
    launch_remap(topk_ids, mapping, out)
    return out


_remap_op = torch.library.custom_op("expertcache::remap_topk_ids", _remap, mutates_args=())
_remap_out_op = torch.library.custom_op("expertcache::remap_topk_ids_out", launch_remap, mutates_args=("out",))


@_remap_op.register_fake
def _(topk_ids: torch.Tensor, mapping: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(topk_ids, memory_format=torch.contiguous_format)


@_remap_out_op.register_fake
def _(topk_ids: torch.Tensor, mapping: torch.Tensor, out: torch.Tensor) -> None:
    return None


def remap_topk_ids(topk_ids: torch.Tensor, mapping: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Map every id through ``mapping`` on the device, without a host sync.

    Args:
        topk_ids: ``[T, K]`` (any shape) int32 or int64 expert ids; -1 = skip.
        mapping: ``[E]`` int32 or int64 table on the same device; entries may be -1.
        out: optional output of ``topk_ids``' shape and an integer dtype, contiguous, on the
            same device (for CUDA graphs: a fixed address). Defaults to a new tensor of
            ``topk_ids``' dtype.

    Returns:
        ``out``: ``out[i] = mapping[topk_ids[i]]``; -1 where ``topk_ids[i]`` is -1 (or
        outside ``[0, E)``).

    A ``torch.library`` custom op (``expertcache::remap_topk_ids``): ``torch.compile``
    traces it without a graph break. On a CPU tensor without ``TRITON_INTERPRET=1`` the
    torch reference runs instead.
    """
    _check(topk_ids, mapping, out)
    compiling = torch.compiler.is_compiling()  # eagerly the implementation runs directly
    if out is None:
        return torch.ops.expertcache.remap_topk_ids(topk_ids, mapping) if compiling else _remap(topk_ids, mapping)
    (torch.ops.expertcache.remap_topk_ids_out if compiling else launch_remap)(topk_ids, mapping, out)
    return out


def _check(topk_ids: torch.Tensor, mapping: torch.Tensor, out: torch.Tensor | None) -> None:
    for name, tensor in (("topk_ids", topk_ids), ("mapping", mapping), ("out", out)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
        if not is_dense(tensor):
            raise TypeError(f"{name} must be a dense (strided) tensor, got a {layout_name(tensor)} tensor")
        if tensor.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")
        if tensor.device != topk_ids.device:
            raise ValueError(f"{name} is on {tensor.device}, topk_ids on {topk_ids.device}")
    if mapping.dim() != 1:
        raise ValueError(f"mapping must be 1-D [E], got shape {tuple(mapping.shape)}")
    if out is not None:
        if out.shape != topk_ids.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, topk_ids {tuple(topk_ids.shape)}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
