"""Expert apply on quantised weights for calls of many tokens: a slot-indexed grouped GEMM.

``moe_apply_quant_grouped`` computes what `quant_apply.moe_apply_quant` computes (same
arguments, same result up to summation order and the rounding of the intermediate) the
way `grouped_apply.moe_apply_grouped` does: pairs sorted by the index they carry into
blocks of ``BLOCK_M`` rows (`grouped_routing.sort_pairs_by_expert`), then::

    gate_up  grid (R/BLOCK_M, I/BLOCK_N):  act[r]  = act_fn(x_t @ W1g[e].T + b, x_t @ W1u[e].T + b)
    down     grid (R/BLOCK_M, H/BLOCK_N):  part[p] = topk_weight[p] * (act[r] @ W2[e].T + b2)   fp32
    sum_k    `expert_apply.launch_sum`, in k order

Dequantisation happens on the tile: a K step multiplies the raw decoded values (e4m3 or
e2m1, exact in fp16 and bf16) on tensor cores and scales the fp32 partial product per
output column (fp8: the step lies inside one scale column; MXFP4: a step is one group of
32, as two K=16 products of the even and the odd columns); unquantised weights (format
``"none"``) take fp8's path without the scale. 16-bit ``hidden`` multiplies in its dtype and
rounds ``act`` to it (as fused MoE kernels do); fp32 ``hidden``, or unquantised weights of
another dtype than ``hidden``'s, multiply in fp32 with ``input_precision="ieee"``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import on_device
from expertcache.kernels.apply_checks import check_invalid_counter
from expertcache.kernels.expert_apply import launch_sum
from expertcache.kernels.grouped_apply import default_tiles
from expertcache.kernels.grouped_routing import sort_pairs_by_expert
from expertcache.kernels.quant_common import (
    FORMAT_MXFP4,
    FORMAT_NONE,
    QuantOperands,
    activate,
    e2m1_to_float,
    e8m0_to_float,
    quant_operands,
    reduction_block,
)
from expertcache.quant import QuantScheme
from expertcache.quant_tensors import weights_of
from expertcache.result import ExpertWeightResult
from expertcache.validation import check_flag


@triton.jit
def _dot(x, w, FP32_DOT: tl.constexpr):
    if FP32_DOT:
        product = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        product = tl.dot(x, w.to(x.dtype))
    return product


@triton.jit
def _tile_product(
    w_ptr, scale_ptr, x_rows, row_mask, w_rows, w_mask, columns, stride_row, stride_scale_row, scale_rows, scale_cols,
    FORMAT: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_M, BLOCK_N]`` fp32: ``x @ W[w_rows].T`` decoded, ``x_rows`` ``[BLOCK_M, 1]`` row pointers."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows64 = w_rows.to(tl.int64)
    if FORMAT != 1:  # fp8 (0), scaled per output column in a step; unquantised (2): no scale
        scale_row = scale_ptr + (w_rows64 // scale_rows) * stride_scale_row
        for start in range(0, columns, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_mask = ks < columns
            x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_tile = w_ptr + w_rows64[None, :] * stride_row + ks[:, None]
            w = tl.load(w_tile, mask=k_mask[:, None] & w_mask[None, :], other=0.0)
            product = _dot(x, w, FP32_DOT)
            if FORMAT == 0:
                scale = tl.load(scale_row + start // scale_cols, mask=w_mask, other=0.0).to(tl.float32)
                product = product * scale[None, :]
            acc += product
    else:
        pairs = tl.arange(0, 16)
        for group in range(0, (columns + 31) // 32):
            even = group * 32 + 2 * pairs
            x_even = tl.load(x_rows + even[None, :], mask=row_mask[:, None] & (even < columns)[None, :], other=0.0)
            x_odd = tl.load(x_rows + even[None, :] + 1, mask=row_mask[:, None] & (even + 1 < columns)[None, :],
                            other=0.0)  # fmt: skip
            packed = tl.load(w_ptr + w_rows64[None, :] * stride_row + group * 16 + pairs[:, None],
                             mask=w_mask[None, :], other=0)  # fmt: skip
            partial = _dot(x_even, e2m1_to_float(packed & 0xF), FP32_DOT)
            partial += _dot(x_odd, e2m1_to_float(packed >> 4), FP32_DOT)
            codes = tl.load(scale_ptr + w_rows64 * stride_scale_row + group, mask=w_mask, other=0)
            acc += partial * e8m0_to_float(codes)[None, :]
    return acc


@triton.jit
def _gate_up_kernel(
    hidden_ptr, pair_ptr, expert_ptr, act_ptr,
    w_ptr, scale_ptr, bias_ptr, stride_expert, stride_row, stride_scale_expert, stride_scale_row, stride_bias,
    scale_rows, scale_cols,
    hidden_size, inter_size, top_k, num_pairs, num_rows, stride_token, row_step, up_offset, alpha, limit,
    FORMAT: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if (expert < 0) | (expert >= num_rows):  # past the used blocks, or pairs that contribute nothing
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ptr + rows)
    row_mask = pairs < num_pairs  # padding holds num_pairs
    x_rows = hidden_ptr + tl.where(row_mask, pairs // top_k, 0)[:, None] * stride_token
    outputs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = outputs < inter_size
    gate_rows = outputs * row_step
    w = w_ptr + expert.to(tl.int64) * stride_expert
    scales = scale_ptr + expert.to(tl.int64) * stride_scale_expert
    steps = (hidden_size, stride_row, stride_scale_row, scale_rows, scale_cols)
    gate = _tile_product(w, scales, x_rows, row_mask, gate_rows, out_mask, *steps,
                         FORMAT, FP32_DOT, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    up = _tile_product(w, scales, x_rows, row_mask, gate_rows + up_offset, out_mask, *steps,
                       FORMAT, FP32_DOT, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    if HAS_BIAS:
        bias = bias_ptr + expert.to(tl.int64) * stride_bias
        gate += tl.load(bias + gate_rows, mask=out_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias + gate_rows + up_offset, mask=out_mask, other=0.0).to(tl.float32)[None, :]
    act = activate(gate, up, alpha, limit, ACTIVATION)
    store_mask = row_mask[:, None] & out_mask[None, :]
    tl.store(act_ptr + rows[:, None] * inter_size + outputs[None, :], act.to(act_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _down_kernel(
    act_ptr, pair_ptr, expert_ptr, weights_ptr, part_ptr,
    w_ptr, scale_ptr, bias_ptr, stride_expert, stride_row, stride_scale_expert, stride_scale_row, stride_bias,
    scale_rows, scale_cols,
    hidden_size, inter_size, num_pairs, num_rows,
    FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, WRITE_ALL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if (expert < 0) | ((expert >= num_rows) & (not WRITE_ALL)):  # later passes keep other passes' rows
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ptr + rows)
    row_mask = pairs < num_pairs
    outputs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = outputs < hidden_size
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if expert < num_rows:  # else: ids that contribute nothing get zero rows, read no weights
        acc = _tile_product(w_ptr + expert.to(tl.int64) * stride_expert,
                            scale_ptr + expert.to(tl.int64) * stride_scale_expert,
                            act_ptr + rows[:, None] * inter_size, row_mask, outputs, out_mask,
                            inter_size, stride_row, stride_scale_row, scale_rows, scale_cols,
                            FORMAT, FP32_DOT, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        if HAS_BIAS:
            bias = bias_ptr + expert.to(tl.int64) * stride_bias
            acc += tl.load(bias + outputs, mask=out_mask, other=0.0).to(tl.float32)[None, :]
        acc = acc * tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(part_ptr + pairs[:, None] * hidden_size + outputs[None, :], acc,
             mask=row_mask[:, None] & out_mask[None, :])  # fmt: skip


def moe_apply_quant_grouped(
    hidden: torch.Tensor,
    weights: Mapping[str, torch.Tensor] | ExpertWeightResult,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    scheme: QuantScheme,
    invalid_ids: torch.Tensor | None = None,
    fp32_out: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """`moe_apply_quant` as grouped GEMMs on tensor cores (arguments and result as there).

    Args:
        block_m, block_n: tile rows (pairs) and columns (outputs), powers of two of at
            least 16; None: `grouped_apply.default_tiles`. The K step follows the format
            (fp8: a power of two of at least 16 dividing the scale block's columns, else
            NotImplementedError; MXFP4: 32).

    Returns:
        ``[T, H]`` in ``hidden``'s dtype (fp32 with ``fp32_out``), summed over k in k order;
        for 16-bit ``hidden`` the intermediate activation is rounded to its dtype.
    """
    ops = quant_operands(hidden, weights_of(weights), topk_weights, topk_ids, scheme)
    check_invalid_counter(invalid_ids, hidden.device)
    check_flag("fp32_out", fp32_out)
    tiles = quant_tiles(hidden, ops, topk_ids.numel(), block_m, block_n)
    tokens, top_k = topk_ids.shape
    out_dtype = torch.float32 if fp32_out else hidden.dtype
    if tokens == 0 or top_k == 0:  # the mixture of no expert is zero
        return torch.zeros(tokens, ops.hidden_size, dtype=out_dtype, device=hidden.device)
    ids = topk_ids.contiguous()
    part = torch.empty(tokens * top_k, ops.hidden_size, dtype=torch.float32, device=hidden.device)
    out = torch.empty(tokens, ops.hidden_size, dtype=out_dtype, device=hidden.device)
    counter = torch.zeros(1, dtype=torch.int64, device=hidden.device)
    with on_device(hidden.device):
        launch_quant_grouped_pairs(hidden, ops, ids, topk_weights.contiguous(), part, True, tiles)
        launch_sum(part, ids, counter, out, ops.num_rows)
    if invalid_ids is not None:
        invalid_ids.add_(counter)
    return out


def quant_tiles(hidden, ops: QuantOperands, num_pairs: int, block_m=None, block_n=None) -> tuple[int, ...]:
    """``(block_m, block_n, block_k1, block_k2, num_warps, num_stages)`` of one call."""
    tensor_cores = not multiplies_in_fp32(hidden, ops)
    default_m, default_n, default_k, num_warps, num_stages = default_tiles(
        num_pairs, ops.hidden_size, ops.inter_size, tensor_cores
    )
    block_m = default_m if block_m is None else block_m
    block_n = default_n if block_n is None else block_n
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(size, int) or size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two of at least 16 (tl.dot's smallest tile), got {size!r}")
    steps = []
    for projection in (ops.w1, ops.w2):
        step = 32 if ops.format == FORMAT_MXFP4 else reduction_block(projection, ops.format, max(default_k, 16))
        if step < 16:
            raise NotImplementedError(
                f"fp8 scale blocks of {projection.scale_cols} columns: the grouped apply needs K steps of at "
                f"least 16 inside one scale column (use moe_apply_quant)"
            )
        steps.append(step)
    return block_m, block_n, *steps, num_warps, num_stages


def multiplies_in_fp32(hidden: torch.Tensor, ops: QuantOperands) -> bool:
    """fp32 products (``input_precision="ieee"``) for fp32 ``hidden``, and for unquantised
    weights of another dtype than 16-bit ``hidden`` (casting them to it would round them)."""
    if hidden.dtype not in (torch.float16, torch.bfloat16):
        return True
    return ops.format == FORMAT_NONE and any(p.weight.dtype != hidden.dtype for p in (ops.w1, ops.w2))


def launch_quant_grouped_pairs(hidden, ops: QuantOperands, ids, weights, part, write_all: bool, tiles) -> None:
    """Route, gate_up, down: ``part[t*K + k]`` = weighted expert output for ids in
    ``[0, N)``; other rows get zeros (``write_all``) or stay as they were (a later pass)."""
    block_m, block_n, block_k1, block_k2, num_warps, num_stages = tiles
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    routing = sort_pairs_by_expert(ids, ops.num_rows, block_m)
    num_blocks = routing.expert_of_block.numel()
    fp32_dot = multiplies_in_fp32(hidden, ops)
    act_dtype = torch.float32 if fp32_dot else hidden.dtype
    act = torch.empty(num_blocks * block_m, ops.inter_size, dtype=act_dtype, device=hidden.device)
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, FP32_DOT=fp32_dot, num_warps=num_warps, num_stages=num_stages)
    _gate_up_kernel[(num_blocks, triton.cdiv(ops.inter_size, block_n))](
        hidden, routing.pair_of_row, routing.expert_of_block, act, *ops.w1.args(),
        ops.hidden_size, ops.inter_size, top_k, pairs, ops.num_rows, hidden.stride(0), ops.row_step, ops.up_offset,
        ops.alpha, ops.limit, FORMAT=ops.format, ACTIVATION=ops.activation, HAS_BIAS=ops.has_bias,
        BLOCK_K=block_k1, **launch,
    )  # fmt: skip
    _down_kernel[(num_blocks, triton.cdiv(ops.hidden_size, block_n))](
        act, routing.pair_of_row, routing.expert_of_block, weights, part, *ops.w2.args(),
        ops.hidden_size, ops.inter_size, pairs, ops.num_rows,
        FORMAT=ops.format, HAS_BIAS=ops.has_bias, WRITE_ALL=write_all, BLOCK_K=block_k2, **launch,
    )  # fmt: skip
