"""The grouped GEMM kernels of `expertcache.kernels.grouped_apply` (that module states the
contract, routes the pairs into blocks, picks the tiles and launches them).

* ``_gate_up_kernel`` (grid ``(R/BLOCK_M, I/BLOCK_N)``): ``act[r] = silu(x_t @ W1g[e].T) *
  (x_t @ W1u[e].T)`` for one block of rows, every pair of it of one expert
  (``expert_of_block``); with ``WAIT`` it first waits for the slot to land
  (`expertcache.kernels.landing`).
* ``_down_kernel`` (grid ``(R/BLOCK_M, H/BLOCK_N)``): ``part[p] = topk_weight[p] * (act[r] @
  W2[e].T)`` in fp32; the blocks of ids that contribute nothing write zero rows
  (``WRITE_ALL``) and read no weights.
* ``_dot``: ``tl.dot`` of 16-bit operands on tensor cores, or of fp32 ones with
  ``input_precision="ieee"`` (``FP32_DOT``).

Blocks past the used ones exit at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from expertcache.kernels.landing import wait_landed


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a.to(b.dtype), b, acc)
    return acc


@triton.jit
def _gate_up_kernel(
    hidden_ptr, w1_ptr, pair_ptr, expert_ptr, act_ptr,
    hidden_size, inter_size, top_k, num_pairs, num_experts, stride_token, stride_expert, stride_row,
    landed_ptr, landed_target, landed_mask,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
    WAIT: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if (expert < 0) | (expert >= num_experts):  # past the used blocks, or pairs that contribute nothing
        return
    if WAIT:  # the slot's copy may still be arriving (expertcache.kernels.landing)
        wait_landed(landed_ptr, expert, landed_target, landed_mask)
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ptr + rows)
    row_mask = pairs < num_pairs  # padding holds num_pairs
    x_rows = hidden_ptr + tl.where(row_mask, pairs // top_k, 0)[:, None] * stride_token
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter_size
    gate_cols = w1_ptr + expert.to(tl.int64) * stride_expert + cols.to(tl.int64)[None, :] * stride_row
    up_cols = gate_cols + inter_size * stride_row
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_size
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate = _dot(x, tl.load(gate_cols + ks[:, None], mask=w_mask, other=0.0), gate, FP32_DOT)
        up = _dot(x, tl.load(up_cols + ks[:, None], mask=w_mask, other=0.0), up, FP32_DOT)
    act = gate / (1.0 + tl.exp(-gate)) * up
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(act_ptr + rows[:, None] * inter_size + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, pair_ptr, expert_ptr, weights_ptr, part_ptr,
    hidden_size, inter_size, num_pairs, num_experts, stride_expert, stride_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
    WRITE_ALL: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if (expert < 0) | ((expert >= num_experts) & (not WRITE_ALL)):  # later passes keep other passes' rows
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ptr + rows)
    row_mask = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_size
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if expert < num_experts:  # else: ids that contribute nothing get zero rows, read no weights
        act_rows = act_ptr + rows[:, None] * inter_size
        w_cols = w2_ptr + expert.to(tl.int64) * stride_expert + cols.to(tl.int64)[None, :] * stride_row
        for start in range(0, inter_size, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_mask = ks < inter_size
            a = tl.load(act_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = _dot(a, w, acc, FP32_DOT)
        acc = acc * tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(part_ptr + pairs[:, None] * hidden_size + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])
