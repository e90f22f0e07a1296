"""Remap kernel: router expert ids -> slot ids through one int32 table.

``out[i] = mapping[topk_ids[i]]``; an id of -1 stays -1. The table composes the EP
``expert_map`` (global -> local, -1 = another rank's) with expert -> slot, so one gather
gives slot ids and the fused kernel's "skip -1" logic works unchanged. Pure indexing with
no control flow on values: it replays inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import runs_on

_BLOCK = 1024


@triton.jit
def _remap_kernel(ids_ptr, mapping_ptr, out_ptr, num_ids, num_entries, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < num_ids
    ids = tl.load(ids_ptr + offsets, mask=in_bounds, other=-1)
    # Out-of-table ids read nothing and come out as -1, so a bad id cannot fault the GPU.
    valid = in_bounds & (ids >= 0) & (ids < num_entries)
    mapped = tl.load(mapping_ptr + ids, mask=valid, other=-1)
    tl.store(out_ptr + offsets, mapped.to(out_ptr.dtype.element_ty), mask=in_bounds)


def remap_topk_ids_torch(topk_ids: torch.Tensor, mapping: torch.Tensor) -> torch.Tensor:
    """Reference: ``mapping[topk_ids]`` with -1 (and any id outside the table) giving -1."""
    valid = (topk_ids >= 0) & (topk_ids < mapping.numel())
    mapped = mapping.to(topk_ids.dtype)[torch.where(valid, topk_ids, 0)]
    return torch.where(valid, mapped, torch.full_like(topk_ids, -1))


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

    On a CPU tensor without ``TRITON_INTERPRET=1`` the torch reference is used instead.
    """
    _check(topk_ids, mapping, out)
    if out is None:
        out = torch.empty_like(topk_ids, memory_format=torch.contiguous_format)
    if not runs_on(_remap_kernel, topk_ids):
        return out.copy_(remap_topk_ids_torch(topk_ids, mapping))
    ids = topk_ids.contiguous()
    num_ids = ids.numel()
    if num_ids:
        grid = (triton.cdiv(num_ids, _BLOCK),)
        _remap_kernel[grid](ids, mapping.contiguous(), out, num_ids, mapping.numel(), BLOCK=_BLOCK)
    return out


_INDEX_DTYPES = (torch.int32, torch.int64)


def _check(topk_ids: torch.Tensor, mapping: torch.Tensor, out: torch.Tensor | None) -> None:
    for name, tensor in (("topk_ids", topk_ids), ("mapping", mapping), ("out", out)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
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
