"""The expert apply summed over expert-group passes, bit-identical to one call.

A call served in passes (`expertcache.passes`) hands the apply one result per pass, each
marking the other passes' ids -1. Summing per-pass outputs would add the ``K`` choices of
a token in another order than one call does; instead every pass writes the weighted
output of its own (token, choice) pairs into one ``[T*K, H]`` fp32 buffer (the first pass
also zeroes the rows no pass of it serves), and the sum over ``k`` runs once, in k order,
after the last pass::

    pass 0:      gate_up, down (every row written)        part [T*K, H] fp32
    pass g > 0:  gate_up, down (only the rows of pass g)
    then:        out[t] = sum over k of part[t*K + k]

gate_up and down are `moe_apply`'s GEMV kernels for small calls and `moe_apply_grouped`'s
tensor-core GEMMs from `grouped_apply.GROUPED_MIN_PAIRS` pairs on (``kernel="auto"``), the
choice made once per call, so all of its passes run the same kernels.

so the output equals `moe_apply` on a provider holding every expert, bit for bit, and a
CUDA graph captures it (no sync; passes of nothing cost launches only).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from expertcache.kernels._launch import on_device
from expertcache.kernels.expert_apply import _check, _check_scales, launch_pairs, launch_sum
from expertcache.kernels.grouped_apply import _TENSOR_CORE_DTYPES, default_tiles, launch_grouped_pairs, takes_grouped
from expertcache.result import ExpertWeightResult


def moe_apply_passes(
    hidden: torch.Tensor,
    results: Iterable[ExpertWeightResult],
    topk_weights: torch.Tensor,
    *,
    scale_block: int = 128,
    fp32_out: bool = False,
    kernel: str = "auto",
) -> torch.Tensor:
    """`moe_apply` over the passes of one call (``provider.passes(topk_ids)``).

    Args:
        hidden: ``[T, H]`` tokens (fp32, fp16 or bf16).
        results: the passes, consumed in order; each pass's kernels are enqueued before
            the next pass is asked for (its copies may overwrite the slots).
        topk_weights: ``[T, K]`` router weights.
        scale_block: as in `moe_apply` (block-scaled fp8 weights).
        fp32_out: return the fp32 sum instead of rounding to ``hidden``'s dtype.
        kernel: ``"auto"`` (by call size), ``"gemv"`` or ``"grouped"``.

    Returns:
        ``[T, H]``: every (token, choice) served by one of the passes, summed in k order.
    """
    if kernel not in ("auto", "gemv", "grouped"):
        raise ValueError(f"kernel must be 'auto', 'gemv' or 'grouped', got {kernel!r}")
    tokens, top_k = topk_weights.shape
    grouped = None
    out_dtype = torch.float32 if fp32_out else hidden.dtype
    weights = topk_weights.contiguous()
    part = act = ids = None
    num_rows = 0
    with on_device(hidden.device):
        for index, result in enumerate(results):
            _check(hidden, result.w1, result.w2, topk_weights, result.topk_ids)
            _check_scales(result.w1, result.w2, result.w1_scale, result.w2_scale, scale_block)
            if part is None:
                part = torch.empty(tokens * top_k, result.w2.shape[1], dtype=torch.float32, device=hidden.device)
                act = torch.empty(tokens * top_k, result.w2.shape[2], dtype=torch.float32, device=hidden.device)
            ids = result.topk_ids.contiguous()
            num_rows = result.w1.shape[0]
            if grouped is None:
                fits = takes_grouped(result.w1, result.w2, result.w1_scale, tokens * top_k)
                grouped = fits if kernel == "auto" else kernel == "grouped"
            if not tokens or not top_k:
                continue
            if grouped:
                tiles = default_tiles(tokens * top_k, *result.w2.shape[1:], result.w1.dtype in _TENSOR_CORE_DTYPES)
                launch_grouped_pairs(hidden, result.w1, result.w2, ids, weights, part, index == 0, tiles)
            else:
                launch_pairs(hidden, result.w1, result.w2, result.w1_scale, result.w2_scale, scale_block, ids,
                             weights, act, part, index == 0)  # fmt: skip
        if part is None or ids is None:
            raise ValueError("results holds no pass")
        out = torch.zeros(tokens, part.shape[1], dtype=out_dtype, device=hidden.device)
        if tokens and top_k:
            launch_sum(part, ids, torch.zeros(1, dtype=torch.int64, device=hidden.device), out, num_rows)
    return out
