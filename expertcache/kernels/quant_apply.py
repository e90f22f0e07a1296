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

How each K step decodes its tile (fp8 pieces inside one scale column, MXFP4 in whole groups
of 32) is in `expertcache.kernels.quant_apply_kernels`, which holds the gate_up and down
kernels. This module owns their tiles per format (and call size): `Tile`, `gate_up_tile`,
`DOWN_TILES` (rows, K step, warps, whether the scaled products are reduced after every step or
accumulated elementwise and reduced once, pieces per step); the launchers that check them
(`launch_gate_up`, `launch_down`); `moe_apply_quant` and its reference `moe_apply_quant_torch`.
Ids outside ``[0, N)`` (-1 included) contribute nothing and read nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import triton

from expertcache.kernels._launch import on_device, program_rows
from expertcache.kernels.apply_checks import check_invalid_counter
from expertcache.kernels.expert_apply import launch_sum
from expertcache.kernels.quant_apply_kernels import _down_kernel, _gate_up_kernel
from expertcache.kernels.quant_common import (
    FORMAT_FP8,
    FORMAT_MXFP4,
    FORMAT_NONE,
    QuantOperands,
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
