"""The quantised GEMV kernels that `expertcache.kernels.quant_apply` launches (that module
states the contract and picks each kernel's `Tile`).

* ``_gate_up_kernel`` (grid ``(T*K, I/BLOCK_I)``): ``act[t,k] = act_fn(W1g[e] @ x_t + b,
  W1u[e] @ x_t + b)`` in fp32.
* ``_down_kernel`` (grid ``(T*K, H/BLOCK_H)``): ``part[t,k] = topk_weight[t,k] * (W2[e] @
  act[t,k] + b2)`` in fp32; rows of ids outside ``[0, N)`` become zeros (``WRITE_ALL``) or
  stay as they are.
* ``_rows_times_vector`` (and ``_pieces_times_vector``, its steps of several pieces):
  decoded ``W[rows] @ x`` of one expert.

Each K step decodes a ``[rows, step]`` tile, or ``[rows, pieces, piece]`` (``CHUNKS``): an
fp8 piece lies inside one scale column (a power of two dividing it), so its scale is one value
per row (unquantised weights: fp8's path, no scale, pieces of up to 256 columns); MXFP4 steps
cover whole groups of 32 (``[rows, groups, 16]`` byte tiles, even and odd columns apart, one
scale per row and group). The scaled products are reduced after every step or accumulated
elementwise and reduced once (``SUM_ONCE``). Ids outside ``[0, N)`` read nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from expertcache.kernels.quant_common import E2M1_PAIR_UNSCALE, activate, e2m1_pair_to_float, e8m0_to_float


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
