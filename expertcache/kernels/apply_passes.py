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
CUDA graph captures it (no sync; passes of nothing cost launches only). `sum_over_passes`
is that driver; `moe_apply_passes` and `quant_passes.moe_apply_quant_passes` differ only in
the kernels a pass launches (`PassLaunch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from expertcache.kernels._launch import on_device
from expertcache.kernels.apply_checks import check_apply_inputs, check_call_inputs, check_scales
from expertcache.kernels.expert_apply import launch_pairs, launch_sum
from expertcache.kernels.grouped_apply import (
    _TENSOR_CORE_DTYPES,
    check_grouped_weights,
    default_tiles,
    launch_grouped_pairs,
    takes_grouped,
)
from expertcache.kernels.landing import check_landed
from expertcache.result import ExpertWeightResult, Landing
from expertcache.validation import check_flag


class PassLaunch(NamedTuple):
    """How one pass's (token, choice) pairs are computed into the shared buffers.

    Attributes:
        num_rows: slot rows of the pass's weights (ids at or past it are skipped by the sum).
        hidden_size: ``H``, the columns of ``part``.
        inter_size: ``I``, the columns of ``act`` (the GEMV's intermediate buffer).
        run: ``run(ids [T, K], weights [T, K], act [T*K, I], part [T*K, H], first)``
            enqueues gate_up and down for the pass; ``first`` also zeroes unserved rows.
    """

    num_rows: int
    hidden_size: int
    inter_size: int
    run: Callable[..., None]


def sum_over_passes(
    hidden: torch.Tensor,
    results: Iterable[ExpertWeightResult],
    topk_weights: torch.Tensor,
    launch_of: Callable[[ExpertWeightResult], PassLaunch],
    *,
    fp32_out: bool = False,
) -> torch.Tensor:
    """The driver every pass-aware apply shares: ``launch_of(result)`` checks a pass and
    says how to compute it; its pairs land in one ``[T*K, H]`` fp32 buffer and the sum over
    k runs once after the last pass. Returns ``[T, H]`` (fp32 with ``fp32_out``).

    Inputs are checked before the first pass is asked for (it may admit and copy): ``hidden``
    and ``topk_weights`` always, and against the weights when ``results`` can show them
    (``results.preview``, `expertcache.provider.PassResults`: a cache's passes); a plain
    iterator's weights are checked as each pass comes.
    """
    check_call_inputs(hidden, topk_weights)
    check_flag("fp32_out", fp32_out)
    tokens, top_k = topk_weights.shape
    preview = getattr(results, "preview", None)
    if callable(preview):  # checks only (shapes, dtypes, devices): the tensors every pass will hold
        launch_of(preview())
    weights = topk_weights.contiguous()
    part = act = ids = None
    num_rows = 0
    with on_device(hidden.device):
        for index, result in enumerate(results):
            launch = launch_of(result)
            ids, num_rows = result.topk_ids.contiguous(), launch.num_rows
            if part is None:
                part = torch.empty(tokens * top_k, launch.hidden_size, dtype=torch.float32, device=hidden.device)
                act = torch.empty(tokens * top_k, launch.inter_size, dtype=torch.float32, device=hidden.device)
            if tokens and top_k:
                launch.run(ids, weights, act, part, index == 0)
        if part is None or ids is None:
            raise ValueError("results holds no pass")
        out_dtype = torch.float32 if fp32_out else hidden.dtype
        if not (tokens and top_k):  # the mixture of no expert is zero
            return torch.zeros(tokens, part.shape[1], dtype=out_dtype, device=hidden.device)
        out = torch.empty(tokens, part.shape[1], dtype=out_dtype, device=hidden.device)
        launch_sum(part, ids, None, out, num_rows)  # writes every row; ids outside [-1, N) add nothing
    return out


def check_landing(landing: Landing, w1: torch.Tensor) -> None:
    """A result's `Landing` counters: ``[N]`` int32 on the weights' device, a positive
    target, and a gate_up target (None, or positive) with an int mask."""
    check_landed(landing.counts, w1.shape[0], w1.device, landing.target)
    if landing.gate_up_target is not None:
        check_landed(landing.counts, w1.shape[0], w1.device, landing.gate_up_target)
    mask = landing.gate_up_mask
    if isinstance(mask, bool) or not isinstance(mask, int) or not -(2**31) <= mask < 2**31:
        raise ValueError(f"gate_up_mask must be an int32 bit mask, got {mask!r}")


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
            the next pass is asked for (its copies may overwrite the slots). A result with
            ``landing`` counters (``provider.passes(ids, overlap=True, landing=True)``) has
            its gate_up wait for each slot to land (`expertcache.kernels.landing`).
        topk_weights: ``[T, K]`` router weights.
        scale_block: as in `moe_apply` (block-scaled fp8 weights).
        fp32_out: return the fp32 sum instead of rounding to ``hidden``'s dtype.
        kernel: ``"auto"`` (by call size), ``"gemv"`` or ``"grouped"``.

    Returns:
        ``[T, H]``: every (token, choice) served by one of the passes, summed in k order.
    """
    if kernel not in ("auto", "gemv", "grouped"):
        raise ValueError(f"kernel must be 'auto', 'gemv' or 'grouped', got {kernel!r}")
    pairs = topk_weights.numel() if isinstance(topk_weights, torch.Tensor) else 0  # [T, K]: checked first
    chosen: list[bool] = []  # grouped or not: decided at the first pass, kept for the call
    done: list[torch.Tensor] = []  # landed GEMV passes: gate_up tiles stored per pair (landing.py)

    def launch_of(result: ExpertWeightResult) -> PassLaunch:
        w1, w2 = result.w1, result.w2
        check_apply_inputs(hidden, w1, w2, topk_weights, result.topk_ids)
        check_scales(w1, w2, result.w1_scale, result.w2_scale, scale_block)
        if kernel == "grouped":
            check_grouped_weights(w1, w2, result.w1_scale)
        if not chosen:
            chosen.append(takes_grouped(w1, w2, result.w1_scale, pairs) if kernel == "auto" else kernel == "grouped")

        landing = result.landing
        if landing is not None:
            check_landing(landing, w1)

        def run(ids, weights, act, part, first):
            if chosen[0]:
                tiles = default_tiles(pairs, *w2.shape[1:], w1.dtype in _TENSOR_CORE_DTYPES)
                launch_grouped_pairs(hidden, w1, w2, ids, weights, part, first, tiles, landing)
                return
            if landing is not None and not done:  # one counter a pair for the call: each pair is one pass's
                done.append(torch.zeros(pairs, dtype=torch.int32, device=hidden.device))
            launch_pairs(hidden, w1, w2, result.w1_scale, result.w2_scale, scale_block, ids, weights, act, part,
                         first, landing, done[0] if landing is not None else None)  # fmt: skip

        return PassLaunch(w1.shape[0], w2.shape[1], w2.shape[2], run)

    return sum_over_passes(hidden, results, topk_weights, launch_of, fp32_out=fp32_out)
