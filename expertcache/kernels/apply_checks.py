"""Checks of an expert apply's inputs (shapes, dtypes, devices, strides, block scales),
shared by every apply kernel's launcher, so each refuses bad input the same way before
anything is launched."""

from __future__ import annotations

import torch

from expertcache.kernels._launch import runs_on
from expertcache.validation import check_int


def check_scales(w1, w2, w1_scale, w2_scale, block: int) -> None:
    if (w1_scale is None) != (w2_scale is None):
        raise ValueError("give both w1_scale and w2_scale, or neither")
    if w1_scale is None:
        return
    check_int("scale_block", block, minimum=1, expected="a positive int")
    for name, scales, weights in (("w1_scale", w1_scale, w1), ("w2_scale", w2_scale, w2)):
        expected = (weights.shape[0], -(-weights.shape[1] // block), -(-weights.shape[2] // block))
        if tuple(scales.shape) != expected:
            raise ValueError(f"{name} must be {list(expected)} (block {block}), got {list(scales.shape)}")
        if not scales.is_floating_point() or scales.device != weights.device or scales.stride(2) != 1:
            raise ValueError(f"{name} must be floating point on {weights.device} with a contiguous last dimension")


def check_call_inputs(hidden, topk_weights) -> None:
    """What a call over passes can check before its first pass: ``hidden`` ``[T, H]`` and
    ``topk_weights`` ``[T, K]``, floating point, on one device."""
    for name, tensor in (("hidden", hidden), ("topk_weights", topk_weights)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if hidden.dim() != 2 or topk_weights.dim() != 2 or topk_weights.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"hidden must be [T, H] and topk_weights [T, K], got {tuple(hidden.shape)} and {tuple(topk_weights.shape)}"
        )
    if not hidden.is_floating_point() or not topk_weights.is_floating_point():
        raise TypeError(f"hidden and topk_weights must be floating point, got {hidden.dtype}, {topk_weights.dtype}")
    if topk_weights.device != hidden.device:
        raise ValueError(f"topk_weights is on {topk_weights.device}, hidden on {hidden.device}")


def check_apply_inputs(hidden, w1, w2, topk_weights, topk_ids) -> None:
    for name, tensor in (
        ("hidden", hidden),
        ("w1", w1),
        ("w2", w2),
        ("topk_weights", topk_weights),
        ("topk_ids", topk_ids),
    ):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if not runs_on(hidden):
        raise RuntimeError("moe_apply needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    if hidden.dim() != 2 or w1.dim() != 3 or w2.dim() != 3 or topk_ids.dim() != 2:
        raise ValueError("hidden must be [T, H], w1 [N, 2I, H], w2 [N, H, I], topk_ids [T, K]")
    if w1.shape[1] != 2 * w2.shape[2] or w1.shape[2] != w2.shape[1] or hidden.shape[1] != w2.shape[1]:
        raise ValueError(f"shapes disagree: hidden {tuple(hidden.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if w1.shape[0] != w2.shape[0]:
        raise ValueError(f"w1 and w2 index different numbers of experts: {w1.shape[0]} and {w2.shape[0]}")
    if w1.stride(2) != 1 or w2.stride(2) != 1 or hidden.stride(1) != 1:
        raise ValueError("the last dimension of hidden, w1 and w2 must be contiguous")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError("topk_ids and topk_weights must both be [T, K] with T = hidden.shape[0]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not hidden.is_floating_point() or not topk_weights.is_floating_point():
        raise TypeError(f"hidden and topk_weights must be floating point, got {hidden.dtype}, {topk_weights.dtype}")
    if not w1.is_floating_point() or not w2.is_floating_point():
        raise TypeError(
            f"w1 and w2 must be floating-point weights (fp32, fp16, bf16 or fp8), got {w1.dtype}, {w2.dtype}; "
            f"packed or integer formats go through expertcache.kernels.moe_apply_quant"
        )
    for name, tensor in (("w1", w1), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device}, hidden on {hidden.device}")


def check_invalid_counter(invalid_ids: torch.Tensor | None, device: torch.device) -> None:
    """An apply's optional ``invalid_ids`` counter: a ``[1]`` int64 tensor on ``device``."""
    if invalid_ids is not None and (
        not isinstance(invalid_ids, torch.Tensor)
        or invalid_ids.dtype != torch.int64
        or invalid_ids.numel() != 1
        or invalid_ids.device != device
    ):
        raise ValueError(f"invalid_ids must be a [1] int64 counter on {device}")
