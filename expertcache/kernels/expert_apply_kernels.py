"""The GEMV kernels of `expertcache.kernels.expert_apply.moe_apply` (that module states the
contract, picks the tiles and launches them).

* ``_gate_up_kernel`` (grid ``(T*K, I/BLOCK_I)``): ``act[t,k] = silu(W1g[e] @ x_t) * (W1u[e] @ x_t)``
  in fp32, products accumulated elementwise and reduced once after the loop.
* ``_down_kernel`` (grid ``(T*K, H/BLOCK_H)``): ``part[t,k] = topk_weight[t,k] * (W2[e] @ act[t,k])``
  in fp32; rows of ids outside ``[0, N)`` become zeros (``WRITE_ALL``) or stay as they are.
* ``_scaled``: a weight tile in fp32, times its fp8 block scales (``HAS_SCALE``).

Ids outside ``[0, N)`` read nothing. With ``PDL`` (sm_90+) each kernel launches while the one
before it runs and waits for it on the GPU; with ``WAIT`` gate_up waits for each slot's ``w1``
to land and counts each pair's stored tiles, and down starts on a pair once its tiles are
counted and its slot has landed whole (`expertcache.kernels.landing`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from expertcache.kernels.landing import wait_landed


@triton.jit
def _scaled(weights, scale_ptr, rows, cols, mask, HAS_SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr, stride_scale_row):
    weights = weights.to(tl.float32)
    if HAS_SCALE:
        index = (rows // SCALE_BLOCK)[:, None] * stride_scale_row + (cols // SCALE_BLOCK)[None, :]
        weights = weights * tl.load(scale_ptr + index, mask=mask, other=0.0).to(tl.float32)
    return weights


@triton.jit
def _gate_up_kernel(
    hidden_ptr, w1_ptr, scale_ptr, ids_ptr, act_ptr,
    hidden_size, inter_size, top_k, num_rows, stride_token, stride_expert, stride_row,
    stride_scale_expert, stride_scale_row, landed_ptr, landed_target, landed_mask, done_ptr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    PDL: tl.constexpr, WAIT: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched while the previous kernel (the copy) runs: wait for the slots it fills
        gdc_wait()
        gdc_launch_dependents()  # and let the down kernel launch: it waits for this one
    pair = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    row_mask = rows < inter_size
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    # products accumulate elementwise and are reduced once after the loop: a reduction per
    # step would stall the loads behind it (2.5x slower at T=1 on an H200)
    gate = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
    up = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
    if (expert >= 0) & (expert < num_rows):  # anything else contributes nothing, reads nothing
        if WAIT:  # the slot's w1 may still be arriving (expertcache.kernels.landing)
            wait_landed(landed_ptr, expert, landed_target, landed_mask)
        x_row = hidden_ptr + (pair // top_k) * stride_token
        gate_rows = w1_ptr + expert * stride_expert + rows.to(tl.int64)[:, None] * stride_row
        up_rows = gate_rows + inter_size * stride_row
        scales = scale_ptr + expert * stride_scale_expert
        for start in range(0, hidden_size, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_mask = cols < hidden_size
            x = tl.load(x_row + cols, mask=col_mask, other=0.0).to(tl.float32)
            mask = row_mask[:, None] & col_mask[None, :]
            g = tl.load(gate_rows + cols[None, :], mask=mask, other=0.0)
            u = tl.load(up_rows + cols[None, :], mask=mask, other=0.0)
            g = _scaled(g, scales, rows, cols, mask, HAS_SCALE, SCALE_BLOCK, stride_scale_row)
            u = _scaled(u, scales, rows + inter_size, cols, mask, HAS_SCALE, SCALE_BLOCK, stride_scale_row)
            gate += g * x[None, :]
            up += u * x[None, :]
    gate_sum = tl.sum(gate, axis=1)
    act = gate_sum / (1.0 + tl.exp(-gate_sum)) * tl.sum(up, axis=1)
    if (expert >= 0) & (expert < num_rows):  # only a served pair's act is read (by down)
        tl.store(act_ptr + pair * inter_size + rows, act, mask=row_mask)
        if WAIT:  # tell the down kernel this tile of the pair's act is stored (expertcache.kernels.landing)
            tl.debug_barrier()
            tl.atomic_add(done_ptr + pair, 1, sem="release", scope="gpu")


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, scale_ptr, ids_ptr, weights_ptr, part_ptr,
    hidden_size, inter_size, num_rows, stride_expert, stride_row, stride_scale_expert, stride_scale_row,
    done_ptr, done_target, landed_ptr, landed_target,
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    WRITE_ALL: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched while gate_up runs: wait for its act (WAIT: for each pair's, below)
        if not WAIT:
            gdc_wait()
        gdc_launch_dependents()
    pair = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_mask = rows < hidden_size
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    served = (expert >= 0) & (expert < num_rows)
    if served:
        if WAIT:  # every gate_up tile of this pair has stored its act, and the slot's w2 has landed
            wait_landed(done_ptr, pair, done_target, -1)
            wait_landed(landed_ptr, expert, landed_target, -1)
        w_rows = w2_ptr + expert * stride_expert + rows.to(tl.int64)[:, None] * stride_row
        scales = scale_ptr + expert * stride_scale_expert
        for start in range(0, inter_size, BLOCK_I):
            cols = start + tl.arange(0, BLOCK_I)
            col_mask = cols < inter_size
            mask = row_mask[:, None] & col_mask[None, :]
            a = tl.load(act_ptr + pair * inter_size + cols, mask=col_mask, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=mask, other=0.0)
            w = _scaled(w, scales, rows, cols, mask, HAS_SCALE, SCALE_BLOCK, stride_scale_row)
            acc += tl.sum(w * a[None, :], axis=1)
        acc = acc * tl.load(weights_ptr + pair).to(tl.float32)
    if WRITE_ALL:  # rows of other passes (or of no expert) become zeros
        tl.store(part_ptr + pair * hidden_size + rows, acc, mask=row_mask)
    elif served:  # other rows belong to another pass: left as they are
        tl.store(part_ptr + pair * hidden_size + rows, acc, mask=row_mask)
    if PDL:
        if WAIT:  # end after gate_up, as without WAIT: what follows this kernel follows both
            gdc_wait()
