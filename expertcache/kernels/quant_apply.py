"""Expert apply on quantised weights for decode-sized calls: GEMV, dequantised in registers.

``moe_apply_quant(hidden, weights, topk_weights, topk_ids, scheme=...)`` computes what
`expertcache.reference.quant_moe_forward` computes (the scheme's gated MLP on the dequantised
weights), reading the packed ``[N, ...]`` tensors of a slot pool (slot ids) or of all-resident
experts (expert ids) in place: fp8 e4m3 with block or per-tensor scales, GPT-OSS MXFP4
with biases, or unquantised bf16/fp16/fp32 weights (format ``"none"``, e.g. ``GPT_OSS_BF16``:
the same MLP options, so one model's formats run the same kernels). Like
`expert_apply.moe_apply`, three launches, fp32 throughout, no atomics::

    gate_up  grid (T*K, I/BLOCK_I):  act[t,k]  = act_fn(W1g[e] @ x_t + b, W1u[e] @ x_t + b)  fp32
    down     grid (T*K, H/BLOCK_H):  part[t,k] = topk_weight[t,k] * (W2[e] @ act[t,k] + b2)  fp32
    sum_k    grid (T, H/256):        out[t]    = sum over k of part[t,k], in k order

Each K step decodes a ``[rows, step]`` tile, or ``[rows, pieces, piece]`` (`Tile.chunks`): an
fp8 piece lies inside one scale column (a power of two dividing it), so its scale is one value
per row (unquantised weights: fp8's path, no scale, pieces of up to 256 columns); MXFP4 steps
cover whole groups of 32 (``[rows, groups, 16]`` byte tiles, even and odd columns apart, one
scale per row and group). The scaled
products are reduced after every step or accumulated elementwise and reduced once, as each
kernel's tile for the format (and call size) says (`gate_up_tile`, `DOWN_TILES`, `Tile`).
Ids outside ``[0, N)`` (-1 included) contribute nothing and read nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import on_device, program_rows
from expertcache.kernels.apply_checks import check_invalid_counter
from expertcache.kernels.expert_apply import launch_sum
from expertcache.kernels.quant_common import (
    E2M1_PAIR_UNSCALE,
    FORMAT_FP8,
    FORMAT_MXFP4,
    FORMAT_NONE,
    QuantOperands,
    activate,
    e2m1_pair_to_float,
    e8m0_to_float,
    quant_operands,
    reduction_block,
)
from expertcache.quant import QuantScheme
from expertcache.quant_tensors import weights_of
from expertcache.reference import quant_moe_forward
from expertcache.result import ExpertWeightResult
from expertcache.validation import check_flag


class Tile(NamedTuple):
    """A GEMV launch's tile: output rows per program, the most columns a K piece takes
    (`quant_common.reduction_block` may take fewer: an fp8 piece ends inside one scale
    column), warps, whether products are accumulated elementwise and reduced once after the
    loop (else after every step), and pieces per K step (fp8 and 16-bit weights; each piece
    has its own scale, so a step may span several scale columns)."""

    rows: int
    max_step: int
    warps: int
    sum_once: bool
    chunks: int = 1


# Per format, the tiles with the best geometric mean over T = 1..8 on an H200 (runs 25 and 27,
# benchmarks/bench_quant_gemv.py; benchmarks/README.md). The tile before the sweep, Tile(16, 256,
# 4, sum_once=False), stays where it won: fp8 from T = 4 and fp8's down, MXFP4's down.
GATE_UP_TILES = {
    FORMAT_FP8: Tile(rows=16, max_step=256, warps=4, sum_once=False),
    FORMAT_MXFP4: Tile(rows=16, max_step=256, warps=4, sum_once=True),
    FORMAT_NONE: Tile(rows=8, max_step=64, warps=4, sum_once=True),
}
DOWN_TILES = {
    FORMAT_FP8: Tile(rows=16, max_step=256, warps=4, sum_once=False),
    FORMAT_MXFP4: Tile(rows=16, max_step=256, warps=4, sum_once=False),
    FORMAT_NONE: Tile(rows=32, max_step=256, warps=8, sum_once=True),
}
#: Calls of at most this many tokens take `SMALL_CALL_GATE_UP_TILES` where the format has one:
#: fp8's gate_up at T = 1 / 2 takes 14.5 / 25.8 us with steps of four 128-column pieces
#: (27.1 / 30.1 with the tile above), and is slower from T = 4 (47.9 against 41.9; run 27).
SMALL_CALL_TOKENS = 2
SMALL_CALL_GATE_UP_TILES = {FORMAT_FP8: Tile(rows=8, max_step=128, warps=4, sum_once=True, chunks=4)}


def gate_up_tile(format: int, tokens: int) -> Tile:
    """The gate_up tile of a call of ``tokens`` tokens in the kernels' ``format`` code."""
    if tokens <= SMALL_CALL_TOKENS and format in SMALL_CALL_GATE_UP_TILES:
        return SMALL_CALL_GATE_UP_TILES[format]
    return GATE_UP_TILES[format]


@triton.jit
def _rows_times_vector(
    w_ptr, scale_ptr, x_ptr, rows, row_mask, columns, stride_row, stride_scale_row, scale_rows, scale_cols,
    FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SUM_ONCE: tl.constexpr,
    CHUNKS: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_R]`` fp32: decoded ``W[rows] @ x`` of one expert (``w_ptr``, ``scale_ptr`` at it).
    ``SUM_ONCE``: scaled products accumulate elementwise, reduced once after the loop (a
    reduction per step can stall the loads behind it); else each step's sum is scaled and added."""
    rows64 = rows.to(tl.int64)
    if FORMAT != 1 and CHUNKS > 1:
        result = _pieces_times_vector(w_ptr, scale_ptr, x_ptr, rows64, row_mask, columns, stride_row,
                                      stride_scale_row, scale_rows, scale_cols, FORMAT, BLOCK_K, BLOCK_R, SUM_ONCE,
                                      CHUNKS)  # fmt: skip
    elif FORMAT != 1:  # fp8: one scale per row in a step; unquantised (2): no scale
        scale_row = scale_ptr + (rows64 // scale_rows) * stride_scale_row
        if SUM_ONCE:
            acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, columns, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_mask = cols < columns
            x = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            mask = row_mask[:, None] & col_mask[None, :]
            w = tl.load(w_ptr + rows64[:, None] * stride_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if FORMAT == 0:
                scale = tl.load(scale_row + start // scale_cols, mask=row_mask, other=0.0).to(tl.float32)
            else:
                scale = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
            if SUM_ONCE:
                acc += w * x[None, :] * scale[:, None]
            else:
                acc += tl.sum(w * x[None, :], axis=1) * scale
        if SUM_ONCE:
            result = tl.sum(acc, axis=1)
        else:
            result = acc
    else:  # MXFP4: BLOCK_K // 32 groups a step, bytes [rows, groups, 16]
        num_groups = (columns + 31) // 32
        pairs = tl.arange(0, 16)
        if SUM_ONCE:
            acc = tl.zeros([BLOCK_R, BLOCK_K // 32, 16], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for first in range(0, num_groups, BLOCK_K // 32):
            groups = first + tl.arange(0, BLOCK_K // 32)
            group_mask = groups < num_groups
            even = groups[:, None] * 32 + 2 * pairs[None, :]  # [groups, 16] column of each low nibble
            x_even = tl.load(x_ptr + even, mask=even < columns, other=0.0).to(tl.float32)
            x_odd = tl.load(x_ptr + even + 1, mask=even + 1 < columns, other=0.0).to(tl.float32)
            byte_mask = row_mask[:, None, None] & group_mask[None, :, None]
            offsets = rows64[:, None, None] * stride_row + groups[None, :, None] * 16 + pairs[None, None, :]
            packed = tl.load(w_ptr + offsets, mask=byte_mask, other=0)
            low, high = e2m1_pair_to_float(packed)  # each value / 2**14: undone after the sum
            code_mask = row_mask[:, None] & group_mask[None, :]
            codes = tl.load(scale_ptr + rows64[:, None] * stride_scale_row + groups[None, :], mask=code_mask, other=0)
            products = low * x_even[None, :, :] + high * x_odd[None, :, :]  # [BLOCK_R, groups, 16]
            if SUM_ONCE:
                acc += products * e8m0_to_float(codes)[:, :, None]
            else:
                acc += tl.sum(tl.sum(products, axis=2) * e8m0_to_float(codes), axis=1)
        if SUM_ONCE:
            result = tl.sum(tl.sum(acc, axis=2), axis=1) * E2M1_PAIR_UNSCALE
        else:
            result = acc * E2M1_PAIR_UNSCALE
    return result


@triton.jit
def _pieces_times_vector(
    w_ptr, scale_ptr, x_ptr, rows64, row_mask, columns, stride_row, stride_scale_row, scale_rows, scale_cols,
    FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SUM_ONCE: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """`_rows_times_vector` for fp8 / 16-bit weights in K steps of ``CHUNKS`` pieces of
    ``BLOCK_K`` columns (``[BLOCK_R, CHUNKS, BLOCK_K]`` tiles), each piece inside one scale
    column: more bytes in flight a step than one piece when scale columns are narrow."""
    scale_row = scale_ptr + (rows64 // scale_rows) * stride_scale_row
    pieces = tl.arange(0, CHUNKS)
    inner = tl.arange(0, BLOCK_K)
    if SUM_ONCE:
        acc = tl.zeros([BLOCK_R, CHUNKS, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, columns, CHUNKS * BLOCK_K):
        firsts = start + pieces * BLOCK_K  # [CHUNKS] first column of each piece
        cols = firsts[:, None] + inner[None, :]
        col_mask = cols < columns
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        mask = row_mask[:, None, None] & col_mask[None, :, :]
        w = tl.load(w_ptr + rows64[:, None, None] * stride_row + cols[None, :, :], mask=mask, other=0.0)
        w = w.to(tl.float32)
        if FORMAT == 0:
            scale_mask = row_mask[:, None] & (firsts < columns)[None, :]
            scale = tl.load(scale_row[:, None] + (firsts // scale_cols)[None, :], mask=scale_mask, other=0.0)
            scale = scale.to(tl.float32)
        else:
            scale = tl.full([BLOCK_R, CHUNKS], 1.0, dtype=tl.float32)
        if SUM_ONCE:
            acc += w * x[None, :, :] * scale[:, :, None]
        else:
            acc += tl.sum(tl.sum(w * x[None, :, :], axis=2) * scale, axis=1)
    if SUM_ONCE:
        result = tl.sum(tl.sum(acc, axis=2), axis=1)
    else:
        result = acc
    return result


@triton.jit
def _gate_up_kernel(
    hidden_ptr, ids_ptr, act_ptr,
    w_ptr, scale_ptr, bias_ptr, stride_expert, stride_row, stride_scale_expert, stride_scale_row, stride_bias,
    scale_rows, scale_cols,
    hidden_size, inter_size, top_k, num_rows, stride_token, row_step, up_offset, alpha, limit,
    FORMAT: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, SUM_ONCE: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    outputs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = outputs < inter_size
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    gate = tl.zeros([BLOCK_I], dtype=tl.float32)
    up = tl.zeros([BLOCK_I], dtype=tl.float32)
    if (expert >= 0) & (expert < num_rows):  # anything else contributes nothing, reads nothing
        x_row = hidden_ptr + (pair // top_k) * stride_token
        gate_rows = outputs * row_step
        w = w_ptr + expert * stride_expert
        scales = scale_ptr + expert * stride_scale_expert
        gate = _rows_times_vector(w, scales, x_row, gate_rows, mask, hidden_size, stride_row, stride_scale_row,
                                  scale_rows, scale_cols, FORMAT, BLOCK_K, BLOCK_I, SUM_ONCE, CHUNKS)  # fmt: skip
        up_rows = gate_rows + up_offset
        up = _rows_times_vector(w, scales, x_row, up_rows, mask, hidden_size, stride_row, stride_scale_row,
                                scale_rows, scale_cols, FORMAT, BLOCK_K, BLOCK_I, SUM_ONCE, CHUNKS)  # fmt: skip
        if HAS_BIAS:
            bias = bias_ptr + expert * stride_bias
            gate += tl.load(bias + gate_rows, mask=mask, other=0.0).to(tl.float32)
            up += tl.load(bias + gate_rows + up_offset, mask=mask, other=0.0).to(tl.float32)
    act = activate(gate, up, alpha, limit, ACTIVATION)
    tl.store(act_ptr + pair * inter_size + outputs, act, mask=mask)


@triton.jit
def _down_kernel(
    act_ptr, ids_ptr, weights_ptr, part_ptr,
    w_ptr, scale_ptr, bias_ptr, stride_expert, stride_row, stride_scale_expert, stride_scale_row, stride_bias,
    scale_rows, scale_cols,
    hidden_size, inter_size, num_rows,
    FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    SUM_ONCE: tl.constexpr, CHUNKS: tl.constexpr, WRITE_ALL: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = rows < hidden_size
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    served = (expert >= 0) & (expert < num_rows)
    if served:
        acc = _rows_times_vector(w_ptr + expert * stride_expert, scale_ptr + expert * stride_scale_expert,
                                 act_ptr + pair * inter_size, rows, mask, inter_size, stride_row, stride_scale_row,
                                 scale_rows, scale_cols, FORMAT, BLOCK_K, BLOCK_H, SUM_ONCE, CHUNKS)  # fmt: skip
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_bias + rows, mask=mask, other=0.0).to(tl.float32)
        acc = acc * tl.load(weights_ptr + pair).to(tl.float32)
    if WRITE_ALL:  # rows of other passes (or of no expert) become zeros
        tl.store(part_ptr + pair * hidden_size + rows, acc, mask=mask)
    elif served:  # other rows belong to another pass: left as they are
        tl.store(part_ptr + pair * hidden_size + rows, acc, mask=mask)


def moe_apply_quant(
    hidden: torch.Tensor,
    weights: Mapping[str, torch.Tensor] | ExpertWeightResult,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    scheme: QuantScheme,
    invalid_ids: torch.Tensor | None = None,
    fp32_out: bool = False,
) -> torch.Tensor:
    """The gated MoE MLP of ``scheme`` reading packed ``weights[name][topk_ids]`` in place.

    Args:
        hidden: ``[T, H]`` tokens (fp32, fp16 or bf16), contiguous rows.
        weights: ``{name: [N, ...]}`` with ``scheme.names`` (shapes and dtypes in
            `expertcache.quant`), or a provider's `ExpertWeightResult` holding them (its
            ``w1``, ``w2``, ``w1_scale``, ``w2_scale`` and ``extra``).
        topk_weights: ``[T, K]`` router weights.
        topk_ids: ``[T, K]`` int32/int64 indices into the weights (slot ids for a pool's
            result); ids outside ``[0, N)``, -1 included, contribute nothing.
        scheme: the format and MLP (`expertcache.quant.FP8_BLOCK_128`, ``FP8_PER_TENSOR``,
            ``GPT_OSS_MXFP4``, ``GPT_OSS_BF16``, or any `QuantScheme`).
        invalid_ids: optional ``[1]`` int64 counter on ``hidden``'s device; ids outside
            ``[-1, N)`` are added to it.
        fp32_out: return the fp32 accumulator instead of rounding to ``hidden``'s dtype.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype (fp32 with ``fp32_out``), accumulated in fp32.
    """
    ops = quant_operands(hidden, weights_of(weights), topk_weights, topk_ids, scheme)
    check_invalid_counter(invalid_ids, hidden.device)
    check_flag("fp32_out", fp32_out)
    tokens, top_k = topk_ids.shape
    out_dtype = torch.float32 if fp32_out else hidden.dtype
    if tokens == 0 or top_k == 0:  # the mixture of no expert is zero
        return torch.zeros(tokens, ops.hidden_size, dtype=out_dtype, device=hidden.device)
    ids, router = topk_ids.contiguous(), topk_weights.contiguous()
    part = torch.empty(tokens * top_k, ops.hidden_size, dtype=torch.float32, device=hidden.device)
    act = torch.empty(tokens * top_k, ops.inter_size, dtype=torch.float32, device=hidden.device)
    out = torch.empty(tokens, ops.hidden_size, dtype=out_dtype, device=hidden.device)
    counter = torch.zeros(1, dtype=torch.int64, device=hidden.device)
    with on_device(hidden.device):
        launch_quant_pairs(hidden, ops, ids, router, act, part, True)
        launch_sum(part, ids, counter, out, ops.num_rows)
    if invalid_ids is not None:
        invalid_ids.add_(counter)
    return out


def moe_apply_quant_torch(
    hidden: torch.Tensor,
    weights: Mapping[str, torch.Tensor] | ExpertWeightResult,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    scheme: QuantScheme,
) -> torch.Tensor:
    """Reference of `moe_apply_quant`: dequantise in fp32, run the float MLP, round to ``hidden``'s dtype."""
    return quant_moe_forward(hidden, weights, topk_weights, topk_ids, scheme=scheme).to(hidden.dtype)


def launch_quant_pairs(hidden, ops: QuantOperands, ids, weights, act, part, write_all: bool) -> None:
    """gate_up and down over every (token, choice): ``part[t*K + k]`` = weighted expert
    output for ids in ``[0, N)``; other rows get zeros (``write_all``) or stay as they were."""
    gate_up, down = gate_up_tile(ops.format, ids.shape[0]), DOWN_TILES[ops.format]
    gate_up = gate_up._replace(rows=program_rows(gate_up.rows, ops.inter_size))
    down = down._replace(rows=program_rows(down.rows, ops.hidden_size))
    launch_gate_up(hidden, ops, ids, act, gate_up)
    launch_down(act, ops, ids, weights, part, write_all, down)


def launch_gate_up(hidden, ops: QuantOperands, ids, act, tile: Tile) -> None:
    """``act`` ``[T*K, I]`` fp32: the activated gate/up products of every (token, choice)."""
    _check_tile(tile, ops.format)
    _gate_up_kernel[(ids.numel(), triton.cdiv(ops.inter_size, tile.rows))](
        hidden, ids, act, *ops.w1.args(),
        ops.hidden_size, ops.inter_size, ids.shape[1], ops.num_rows, hidden.stride(0), ops.row_step, ops.up_offset,
        ops.alpha, ops.limit, FORMAT=ops.format, ACTIVATION=ops.activation, HAS_BIAS=ops.has_bias,
        BLOCK_I=tile.rows, BLOCK_K=reduction_block(ops.w1, ops.format, tile.max_step), SUM_ONCE=tile.sum_once,
        CHUNKS=tile.chunks, num_warps=tile.warps,
    )  # fmt: skip


def launch_down(act, ops: QuantOperands, ids, weights, part, write_all: bool, tile: Tile) -> None:
    """``part`` ``[T*K, H]`` fp32: each (token, choice)'s down projection times its router weight."""
    _check_tile(tile, ops.format)
    _down_kernel[(ids.numel(), triton.cdiv(ops.hidden_size, tile.rows))](
        act, ids, weights, part, *ops.w2.args(), ops.hidden_size, ops.inter_size, ops.num_rows,
        FORMAT=ops.format, HAS_BIAS=ops.has_bias, BLOCK_H=tile.rows,
        BLOCK_K=reduction_block(ops.w2, ops.format, tile.max_step), SUM_ONCE=tile.sum_once, CHUNKS=tile.chunks,
        WRITE_ALL=write_all, num_warps=tile.warps,
    )  # fmt: skip


def _check_tile(tile: Tile, format: int) -> None:
    """A tile the kernels can take: powers of two, and pieces only where the format has them."""
    sizes = {"rows": tile.rows, "max_step": tile.max_step, "warps": tile.warps, "chunks": tile.chunks}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1 or size & (size - 1):
            raise ValueError(f"Tile.{name} must be a power of two, got {size!r}")
    if format == FORMAT_MXFP4 and tile.chunks != 1:
        raise ValueError(f"MXFP4 steps are whole groups of 32: Tile.chunks must be 1, got {tile.chunks}")
