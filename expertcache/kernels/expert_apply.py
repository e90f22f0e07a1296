"""Expert apply for decode-sized batches: reads weights by index, never gathers them.

``moe_apply(hidden, w1, w2, topk_weights, topk_ids)`` computes what
`expertcache.reference.moe_forward` computes (SiLU-gated MLP per (token, choice), weighted
sum over k), reading ``w1[idx]`` / ``w2[idx]`` in place. ``w1``/``w2`` may be fully resident
``[E, ...]`` weights indexed by expert ids or a slot pool ``[S, ...]`` indexed by slot ids:
the same kernels run either way, so a cache hit costs what the all-resident path costs,
and both give bit-identical outputs. Three launches, no atomic adds into any output
(deterministic; atomics only count invalid ids and signal landed or finished pairs)::

    gate_up  grid (T*K, I/BLOCK_I):  act[t,k]   = silu(W1g[e] @ x_t) * (W1u[e] @ x_t)   fp32
    down     grid (T*K, H/BLOCK_H):  part[t,k]  = topk_weight[t,k] * (W2[e] @ act[t,k])  fp32
    sum_k    grid (T, H/BLOCK_H):    out[t]     = sum over k of part[t,k], in k order

Weights may be fp32/fp16/bf16, or fp8 (e4m3) with DeepSeek-style block scales
(``w1_scale`` ``[N, ceil(2I/B), ceil(H/B)]``, ``w2_scale`` ``[N, ceil(H/B), ceil(I/B)]``,
``B = scale_block``, default 128): each weight is multiplied by its block's scale.

Matrix-vector products, memory-bound at decode batch sizes; for large ``T`` a grouped GEMM
(the host engine's fused MoE) is the right tool.

This module owns the launcher (`moe_apply`, `launch_pairs`: checks, tiles, grid, landing
arguments), its reference (`moe_apply_torch`) and the ``expertcache::moe_apply`` custom op;
the gate_up and down kernels are in `expertcache.kernels.expert_apply_kernels`, the sum over
k that every apply ends with in `expertcache.kernels.sum_over_k`.
"""

from __future__ import annotations

import torch
import triton

from expertcache.kernels._launch import chained, on_device, program_rows
from expertcache.kernels.apply_checks import check_apply_inputs, check_invalid_counter, check_scales
from expertcache.kernels.expert_apply_kernels import _down_kernel, _gate_up_kernel
from expertcache.kernels.sum_over_k import launch_sum
from expertcache.validation import check_flag


def moe_apply(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: int = 128,
    invalid_ids: torch.Tensor | None = None,
    fp32_out: bool = False,
) -> torch.Tensor:
    """SiLU-gated MoE MLP reading ``w1[topk_ids]`` / ``w2[topk_ids]`` in place.

    Args:
        hidden: ``[T, H]`` tokens (fp32, fp16 or bf16), last dimension contiguous.
        w1: ``[N, 2I, H]`` gate then up rows; each expert's matrix row-major.
        w2: ``[N, H, I]`` down projections, same index space.
        topk_weights: ``[T, K]`` router weights.
        topk_ids: ``[T, K]`` int32/int64 indices into ``w1``/``w2``; -1 contributes nothing,
            and so does any id outside ``[0, N)`` (nothing outside the weights is read).
        w1_scale, w2_scale: optional block scales (see the module docstring); both or none.
        scale_block: rows and columns per scale block.
        invalid_ids: optional ``[1]`` int64 counter on ``hidden``'s device; ids outside
            ``[-1, N)`` are added to it (checking them on the host would need a sync).
        fp32_out: return the fp32 accumulator instead of rounding to ``hidden``'s dtype
            (to sum expert-group passes, `expertcache.passes`, before rounding once).

    Returns:
        ``[T, H]`` in ``hidden``'s dtype (fp32 with ``fp32_out``), accumulated in fp32.

    A ``torch.library`` custom op (``expertcache::moe_apply``): ``torch.compile`` traces it
    without a graph break.
    """
    check_apply_inputs(hidden, w1, w2, topk_weights, topk_ids)
    check_scales(w1, w2, w1_scale, w2_scale, scale_block)
    check_invalid_counter(invalid_ids, hidden.device)
    check_flag("fp32_out", fp32_out)
    # Eagerly the implementation runs directly (the dispatcher costs ~10 us a call).
    run = torch.ops.expertcache.moe_apply if torch.compiler.is_compiling() else _moe_apply
    out, invalid = run(hidden, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, scale_block, fp32_out)
    if invalid_ids is not None:
        invalid_ids.add_(invalid)
    return out


def moe_apply_torch(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: int = 128,
) -> torch.Tensor:
    """Reference of `moe_apply`: dequantise (block scales) in fp32, then `reference.moe_forward`."""
    from expertcache.reference import moe_forward

    ids = torch.where((topk_ids >= 0) & (topk_ids < w1.shape[0]), topk_ids, -1)
    w1f, w2f = w1.float(), w2.float()
    if w1_scale is not None and w2_scale is not None:
        w1f = w1f * _expand_scales(w1_scale, w1.shape, scale_block)
        w2f = w2f * _expand_scales(w2_scale, w2.shape, scale_block)
    out = moe_forward(hidden.float(), w1f, w2f, topk_weights.float(), ids)
    return out.to(hidden.dtype)


def _expand_scales(scales: torch.Tensor, shape: torch.Size, block: int) -> torch.Tensor:
    full = scales.float().repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)
    return full[:, : shape[1], : shape[2]]


def _moe_apply(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    scale_block: int,
    fp32_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], invalid [1] int64)``: the MLP, and how many ids were outside ``[-1, N)``."""
    tokens, top_k = topk_ids.shape
    hidden_size, inter_size, num_rows = w2.shape[1], w2.shape[2], w1.shape[0]
    device = hidden.device
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    invalid = torch.zeros(1, dtype=torch.int64, device=device)
    out_dtype = torch.float32 if fp32_out else hidden.dtype
    if tokens == 0 or top_k == 0:  # nothing chosen: the mixture of no expert is zero
        return torch.zeros(tokens, hidden_size, dtype=out_dtype, device=device), invalid
    out = torch.empty(tokens, hidden_size, dtype=out_dtype, device=device)
    act = torch.empty(tokens * top_k, inter_size, dtype=torch.float32, device=device)
    part = torch.empty(tokens * top_k, hidden_size, dtype=torch.float32, device=device)
    with on_device(device):
        launch_pairs(hidden, w1, w2, w1_scale, w2_scale, scale_block, ids, weights, act, part, True)
        launch_sum(part, ids, invalid, out, num_rows)
    return out, invalid


#: ``(rows, columns, warps)`` of a program's weight tile. gate_up: 8 rows x 128 columns over
#: 8 warps, the fastest of 64 tiles at T = 1..8 on an H200 (Qwen3-30B-A3B shapes, bf16, in a
#: CUDA graph: 14.5 us at T=1 against 12.1 us for its bytes at HBM rate; the 16 x 256 tile of
#: a reduction per step took 36.1 us); down: 16 x 256 over 4 warps, its tile before, kept: it
#: beat every elementwise-accumulating down tile tried (8.5 against 8.7 us at T=1).
GATE_UP_TILE = (8, 128, 8)
DOWN_TILE = (16, 256, 4)


def launch_pairs(
    hidden, w1, w2, w1_scale, w2_scale, scale_block, ids, weights, act, part, write_all, landing=None, done=None
) -> None:
    """gate_up and down over every (token, choice): ``part[t*K + k]`` = weighted expert
    output for ids in ``[0, N)``; other rows get zeros (``write_all``) or stay as they were.
    With ``landing`` (`expertcache.result.Landing`) gate_up waits for each slot's ``w1`` to
    land (``landing.gate_up()``) and counts each pair's stored tiles into ``done``
    (``[T*K]`` int32, zero for this pass's pairs), and down starts on each pair as its tiles
    are counted and its slot has landed whole, not after all of gate_up."""
    tokens, top_k = ids.shape
    hidden_size, inter_size, num_rows = w2.shape[1], w2.shape[2], w1.shape[0]
    has_scale = w1_scale is not None
    scale1 = w1_scale if w1_scale is not None else w1  # an unused pointer when there are no scales
    scale2 = w2_scale if w2_scale is not None else w2
    pairs = tokens * top_k
    (gate_rows, gate_cols, gate_warps), (down_rows, down_cols, down_warps) = GATE_UP_TILE, DOWN_TILE
    gate_rows, down_rows = program_rows(gate_rows, inter_size), program_rows(down_rows, hidden_size)
    waits = landing is not None
    if waits and (done is None or done.dtype != torch.int32 or done.numel() != pairs):
        raise ValueError(f"a landed pass needs a [{pairs}] int32 counter of gate_up tiles per pair")
    done_arg = done if done is not None else ids
    _gate_up_kernel[(pairs, triton.cdiv(inter_size, gate_rows))](
        hidden, w1, scale1, ids, act, hidden_size, inter_size, top_k, num_rows,
        hidden.stride(0), w1.stride(0), w1.stride(1), scale1.stride(0), scale1.stride(1),
        *landing_args(landing, ids, gate_up=True), done_arg,
        BLOCK_I=gate_rows, BLOCK_H=gate_cols, HAS_SCALE=has_scale, SCALE_BLOCK=scale_block, num_warps=gate_warps,
        WAIT=waits, **chained(hidden.device),
    )  # fmt: skip
    _down_kernel[(pairs, triton.cdiv(hidden_size, down_rows))](
        act, w2, scale2, ids, weights, part, hidden_size, inter_size, num_rows,
        w2.stride(0), w2.stride(1), scale2.stride(0), scale2.stride(1), done_arg, triton.cdiv(inter_size, gate_rows),
        *landing_args(landing, ids)[:2],
        BLOCK_H=down_rows, BLOCK_I=down_cols, HAS_SCALE=has_scale, SCALE_BLOCK=scale_block, WRITE_ALL=write_all,
        WAIT=waits, num_warps=down_warps, **chained(hidden.device),
    )  # fmt: skip


def landing_args(landing, ids: torch.Tensor, gate_up: bool = False) -> tuple[torch.Tensor, int, int]:
    """``(landed_ptr, landed_target, landed_mask)`` kernel arguments of a kernel that reads
    whole slots, or (``gate_up``) only their ``w1``: the counters, or any int pointer."""
    if landing is None:
        return ids, 0, -1
    return (landing.counts, *landing.gate_up()) if gate_up else (landing.counts, landing.target, -1)


_moe_apply_op = torch.library.custom_op("expertcache::moe_apply", _moe_apply, mutates_args=())


@_moe_apply_op.register_fake
def _(hidden, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, scale_block, fp32_out):
    dtype = torch.float32 if fp32_out else hidden.dtype
    return hidden.new_empty(topk_ids.shape[0], w2.shape[1], dtype=dtype), hidden.new_empty(1, dtype=torch.int64)
