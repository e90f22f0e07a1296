"""The quantised expert apply summed over expert-group passes, bit-identical to one call.

`apply_passes.moe_apply_passes` for packed weights: every pass (`expertcache.passes`)
writes the weighted output of its own (token, choice) pairs into one ``[T*K, H]`` fp32
buffer (the first pass also zeroes the rows none of its ids serve), and the sum over k runs
once, in k order, after the last pass. gate_up and down are `quant_apply`'s GEMV kernels,
or `quant_grouped`'s tensor-core GEMMs from `grouped_apply.GROUPED_MIN_PAIRS` pairs on
(``kernel="auto"``), chosen once per call so that all its passes run the same kernels.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from expertcache.kernels._launch import on_device
from expertcache.kernels.expert_apply import launch_sum
from expertcache.kernels.grouped_apply import GROUPED_MIN_PAIRS
from expertcache.kernels.quant_apply import launch_quant_pairs
from expertcache.kernels.quant_common import quant_operands
from expertcache.kernels.quant_grouped import launch_quant_grouped_pairs, quant_tiles
from expertcache.quant import QuantScheme, weights_of
from expertcache.result import ExpertWeightResult

KERNELS = ("auto", "gemv", "grouped")


def moe_apply_quant_passes(
    hidden: torch.Tensor,
    results: Iterable[ExpertWeightResult],
    topk_weights: torch.Tensor,
    *,
    scheme: QuantScheme,
    fp32_out: bool = False,
    kernel: str = "auto",
) -> torch.Tensor:
    """`quant_apply.moe_apply_quant` over the passes of one call (``provider.passes(topk_ids)``).

    Args:
        hidden: ``[T, H]`` tokens (fp32, fp16 or bf16).
        results: the passes, consumed in order; each pass's kernels are enqueued before the
            next pass is asked for (its copies may overwrite the slots). Each holds
            ``scheme``'s tensors (``w1``, ``w2``, ``w1_scale``, ``w2_scale``, biases in ``extra``).
        topk_weights: ``[T, K]`` router weights.
        scheme: the format and MLP (`expertcache.quant`).
        fp32_out: return the fp32 sum instead of rounding to ``hidden``'s dtype.
        kernel: ``"auto"`` (grouped from `GROUPED_MIN_PAIRS` pairs where the format allows
            it), ``"gemv"`` or ``"grouped"``.

    Returns:
        ``[T, H]``: every (token, choice) served by one of the passes, summed in k order.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    tokens, top_k = topk_weights.shape
    weights = topk_weights.contiguous()
    part = act = ids = tiles = None
    num_rows = 0
    with on_device(hidden.device):
        for index, result in enumerate(results):
            ops = quant_operands(hidden, weights_of(result), topk_weights, result.topk_ids, scheme)
            ids, num_rows = result.topk_ids.contiguous(), ops.num_rows
            if part is None:
                part = torch.empty(tokens * top_k, ops.hidden_size, dtype=torch.float32, device=hidden.device)
                act = torch.empty(tokens * top_k, ops.inter_size, dtype=torch.float32, device=hidden.device)
                tiles = _tiles_or_none(hidden, ops, tokens * top_k, kernel)
            if not tokens or not top_k:
                continue
            if tiles is not None:
                launch_quant_grouped_pairs(hidden, ops, ids, weights, part, index == 0, tiles)
            else:
                launch_quant_pairs(hidden, ops, ids, weights, act, part, index == 0)
        if part is None or ids is None:
            raise ValueError("results holds no pass")
        out = torch.zeros(tokens, part.shape[1], dtype=torch.float32 if fp32_out else hidden.dtype,
                          device=hidden.device)  # fmt: skip
        if tokens and top_k:
            launch_sum(part, ids, torch.zeros(1, dtype=torch.int64, device=hidden.device), out, num_rows)
    return out


def _tiles_or_none(hidden, ops, num_pairs: int, kernel: str) -> tuple[int, ...] | None:
    """The grouped GEMM's tiles when this call takes it, else None (the GEMV)."""
    if kernel == "gemv" or (kernel == "auto" and num_pairs < GROUPED_MIN_PAIRS):
        return None
    try:
        return quant_tiles(hidden, ops, num_pairs)
    except NotImplementedError:
        if kernel == "grouped":
            raise
        return None  # scale blocks the grouped GEMM cannot step through: the GEMV takes any
