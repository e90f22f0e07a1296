"""The quantised expert apply summed over expert-group passes, bit-identical to one call.

`apply_passes.moe_apply_passes` for packed weights: every pass (`expertcache.passes`)
writes the weighted output of its own (token, choice) pairs into one ``[T*K, H]`` fp32
buffer (the first pass also zeroes the rows none of its ids serve), and the sum over k runs
once, in k order, after the last pass. gate_up and down are `quant_apply`'s GEMV kernels,
or `quant_grouped`'s tensor-core GEMMs from the format's `QUANT_GROUPED_MIN_PAIRS` pairs on
(``kernel="auto"``), chosen once per call so that all its passes run the same kernels.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from expertcache.kernels.apply_passes import PassLaunch, sum_over_passes
from expertcache.kernels.quant_apply import launch_quant_pairs
from expertcache.kernels.quant_common import FORMAT_FP8, FORMAT_MXFP4, FORMAT_NONE, quant_operands
from expertcache.kernels.quant_grouped import launch_quant_grouped_pairs, quant_tiles
from expertcache.quant import QuantScheme
from expertcache.quant_tensors import weights_of
from expertcache.result import ExpertWeightResult

KERNELS = ("auto", "gemv", "grouped")

#: Pairs from which ``kernel="auto"`` takes the quantised grouped GEMMs, per format: where the
#: grouped GEMM overtook the GEMV on an H200 (bench_quant_gemv.py, runs 25-26; fp8 at
#: Qwen3-30B-A3B's shape, MXFP4 and 16-bit at GPT-OSS-20B's; benchmarks/README.md): the GEMV
#: was faster at 64 / 64 / 8 pairs, the grouped GEMM at 128 / 128 / 32 (16-bit: equal at 16).
QUANT_GROUPED_MIN_PAIRS = {FORMAT_FP8: 128, FORMAT_MXFP4: 128, FORMAT_NONE: 16}


_NO_LANDING = (
    "moe_apply_quant_passes does not wait on landing counters: serve its passes without landing "
    "(provider.passes(ids, overlap=True))"
)


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
        kernel: ``"auto"`` (grouped from the format's `QUANT_GROUPED_MIN_PAIRS` pairs where it allows
            it), ``"gemv"`` or ``"grouped"``.

    Returns:
        ``[T, H]``: every (token, choice) served by one of the passes, summed in k order.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if getattr(results, "landing", False) is True:  # a cache's PassResults: refused before its first pass
        raise ValueError(_NO_LANDING)
    pairs = topk_weights.numel() if isinstance(topk_weights, torch.Tensor) else 0  # [T, K]: checked first
    chosen: list = []  # the grouped GEMM's tiles, or None for the GEMV: decided at the first pass

    def launch_of(result: ExpertWeightResult) -> PassLaunch:
        if result.landing is not None:
            raise ValueError(_NO_LANDING)
        ops = quant_operands(hidden, weights_of(result), topk_weights, result.topk_ids, scheme)
        if not chosen:
            chosen.append(_tiles_or_none(hidden, ops, pairs, kernel))

        def run(ids, weights, act, part, first):
            if chosen[0] is not None:
                launch_quant_grouped_pairs(hidden, ops, ids, weights, part, first, chosen[0])
            else:
                launch_quant_pairs(hidden, ops, ids, weights, act, part, first)

        return PassLaunch(ops.num_rows, ops.hidden_size, ops.inter_size, run)

    return sum_over_passes(hidden, results, topk_weights, launch_of, fp32_out=fp32_out)


def _tiles_or_none(hidden, ops, num_pairs: int, kernel: str) -> tuple[int, ...] | None:
    """The grouped GEMM's tiles when this call takes it, else None (the GEMV)."""
    if kernel == "gemv" or (kernel == "auto" and num_pairs < QUANT_GROUPED_MIN_PAIRS[ops.format]):
        return None
    try:
        return quant_tiles(hidden, ops, num_pairs)
    except NotImplementedError:
        if kernel == "grouped":
            raise
        return None  # scale blocks the grouped GEMM cannot step through: the GEMV takes any
