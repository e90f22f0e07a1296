"""Expert apply for calls of many tokens: a slot-indexed grouped GEMM on tensor cores.

``moe_apply_grouped`` computes what `moe_apply` computes (same arguments, same result up to
fp32 summation order) for calls where many (token, choice) pairs share an expert, so that
each expert's weights are read once per block of ``BLOCK_M`` rows instead of once per pair.
``w1``/``w2`` may be all-resident ``[E, ...]`` weights or a slot pool ``[S, ...]``; pairs are
grouped by the index they carry, so both give the same rows in the same blocks. Steps, with
``P = T*K`` pairs and ``N`` weight rows (experts or slots); no host sync, fixed shapes::

    route    `grouped_routing.sort_pairs_by_expert`: a stable counting sort of the pairs by
             bucket (id if 0 <= id < N, else N), each bucket padded to whole blocks of
             BLOCK_M rows -> pair_of_row [R], expert_of_block [R/BLOCK_M]
    gate_up  grid (R/BLOCK_M, I/BLOCK_N):  act[r]  = silu(x_t @ W1g[e].T) * (x_t @ W1u[e].T)
    down     grid (R/BLOCK_M, H/BLOCK_N):  part[p] = topk_weight[p] * (act[r] @ W2[e].T)  fp32
    sum_k    `sum_over_k.launch_sum`: out[t] = sum over k of part[t, k], in k order

Blocks past the used ones exit at once; the blocks of bucket N (ids that contribute nothing)
write zero rows of ``part`` and read no weights. ``act`` is fp32 for fp32 ``w2``, else
rounded to ``w2``'s dtype so the down GEMM runs on tensor cores (as fused MoE kernels do;
`moe_apply` keeps it fp32). fp32 operands multiply with ``input_precision="ieee"``.

This module owns the launchers (`moe_apply_grouped`, `launch_grouped_pairs`: checks, tiles,
grid), the choice between GEMV and grouped GEMM (`moe_apply_auto`) and the
``expertcache::moe_apply_grouped`` custom op; the kernels are in
`expertcache.kernels.grouped_apply_kernels`.
"""

from __future__ import annotations

import torch
import triton

from expertcache.kernels._launch import on_device
from expertcache.kernels.apply_checks import check_apply_inputs, check_invalid_counter, check_scales
from expertcache.kernels.expert_apply import landing_args, launch_sum, moe_apply
from expertcache.kernels.grouped_apply_kernels import _down_kernel, _gate_up_kernel
from expertcache.kernels.grouped_routing import sort_pairs_by_expert
from expertcache.validation import check_flag, check_int

#: Pairs (``T*K``) from which `moe_apply_auto` takes the grouped GEMM over the GEMV. Set from
#: the crossover benchmarks/bench_apply.py printed on one H200 (Qwen3-30B-A3B shapes, bf16,
#: graphed, c8c1257): pools of 32/64/128 slots crossed at 64/128/128 pairs; at 128 pairs
#: (T=16) over 128 slots the two were within 1%. Measure again on other GPUs and shapes.
GROUPED_MIN_PAIRS = 128

_TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)


def default_tiles(num_pairs: int, hidden_size: int, inter_size: int, tensor_cores: bool) -> tuple[int, ...]:
    """``(block_m, block_n, block_k, num_warps, num_stages)`` from shapes alone, never from the
    number of weight rows, so a slot pool and all-resident weights tile the same rows the same
    way. Chosen on an H200 at Qwen3-30B-A3B shapes (benchmarks/bench_apply.py, --block-m)."""
    small = min(hidden_size, inter_size)
    if num_pairs < 1024:  # a few rows per expert: the weights' bytes dominate, a long K step
        block_m, block_n, block_k, num_warps, num_stages = 16, 64, 128, 4, 3
    elif num_pairs < 8192:
        block_m, block_n, block_k, num_warps, num_stages = 64, 64, 64, 4, 3
    else:  # prefill: tensor-core bound
        block_m, block_n, block_k, num_warps, num_stages = 64, 128, 64, 8, 4
    if not tensor_cores:  # fp32 tiles take twice the shared memory
        block_k = 32
    block_n = min(block_n, max(16, triton.next_power_of_2(small)))
    block_k = min(block_k, max(16, triton.next_power_of_2(small)))
    return block_m, block_n, block_k, num_warps, num_stages


def moe_apply_grouped(
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
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """SiLU-gated MoE MLP as grouped GEMMs over ``w1[topk_ids]`` / ``w2[topk_ids]``, in place.

    Args:
        hidden: ``[T, H]`` tokens (fp32, fp16 or bf16), last dimension contiguous.
        w1: ``[N, 2I, H]`` gate then up rows (fp32, fp16 or bf16); each matrix row-major.
        w2: ``[N, H, I]`` down projections, same index space and dtypes.
        topk_weights: ``[T, K]`` router weights.
        topk_ids: ``[T, K]`` int32/int64 indices into ``w1``/``w2`` (experts or slots); an id
            outside ``[0, N)``, -1 included, contributes nothing and reads nothing.
        w1_scale, w2_scale, scale_block: block scales are not implemented here (raises
            NotImplementedError); `moe_apply` and `moe_apply_auto` take them.
        invalid_ids: optional ``[1]`` int64 counter on ``hidden``'s device; ids outside
            ``[-1, N)`` are added to it.
        fp32_out: return the fp32 accumulator instead of rounding to ``hidden``'s dtype.
        block_m, block_n, block_k: tile sizes (powers of two, at least 16); None: `default_tiles`.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype (fp32 with ``fp32_out``), accumulated in fp32 and
        summed over k in k order (deterministic). 16-bit operands multiply on tensor cores;
        the intermediate ``silu(gate) * up`` is rounded to ``w2``'s dtype when that is 16-bit.

    A ``torch.library`` custom op (``expertcache::moe_apply_grouped``); no host sync.
    """
    check_apply_inputs(hidden, w1, w2, topk_weights, topk_ids)
    check_scales(w1, w2, w1_scale, w2_scale, scale_block)
    check_grouped_weights(w1, w2, w1_scale)
    check_invalid_counter(invalid_ids, hidden.device)
    check_flag("fp32_out", fp32_out)
    *defaults, num_warps, num_stages = default_tiles(
        topk_ids.numel(), w2.shape[1], w2.shape[2], w1.dtype in _TENSOR_CORE_DTYPES
    )
    given = (block_m, block_n, block_k)
    block_m, block_n, block_k = (
        _tile_size(name, default if size is None else size)
        for name, size, default in zip(("block_m", "block_n", "block_k"), given, defaults, strict=True)
    )
    # Eagerly the implementation runs directly (the dispatcher costs ~10 us a call).
    run = torch.ops.expertcache.moe_apply_grouped if torch.compiler.is_compiling() else _moe_apply_grouped
    tiles = (block_m, block_n, block_k, num_warps, num_stages)
    out, invalid = run(hidden, w1, w2, topk_weights, topk_ids, fp32_out, *tiles)
    if invalid_ids is not None:
        invalid_ids.add_(invalid)
    return out


def moe_apply_auto(
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
    """`moe_apply` for calls of fewer than `GROUPED_MIN_PAIRS` pairs (``T*K``), or with block
    scales or fp8 weights; `moe_apply_grouped` otherwise. Arguments and result as theirs."""
    apply = moe_apply_grouped if takes_grouped(w1, w2, w1_scale, topk_ids.numel()) else moe_apply
    return apply(hidden, w1, w2, topk_weights, topk_ids, w1_scale=w1_scale, w2_scale=w2_scale,
                 scale_block=scale_block, invalid_ids=invalid_ids, fp32_out=fp32_out)  # fmt: skip


def _tile_size(name: str, size: object) -> int:
    """A tile size as a Python int: a power of two of at least 16 (numpy's ints too)."""
    expected = "a power of two of at least 16 (tl.dot's smallest tile)"
    number = check_int(name, size, expected=expected)  # never a bool or a float
    if number < 16 or number & (number - 1):
        raise ValueError(f"{name} must be {expected}, got {number!r}")
    return number


def check_grouped_weights(w1: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor | None) -> None:
    """What the grouped GEMM computes: fp32/fp16/bf16 weights without block scales.

    Raises:
        NotImplementedError: block scales, or weights of another dtype (fp8): `moe_apply` takes them.
    """
    if w1_scale is not None:
        raise NotImplementedError("the grouped apply has no block scales yet: use moe_apply (or moe_apply_auto)")
    if w1.dtype not in (torch.float32, *_TENSOR_CORE_DTYPES) or w2.dtype not in (torch.float32, *_TENSOR_CORE_DTYPES):
        raise NotImplementedError(f"the grouped apply takes fp32/fp16/bf16 weights, got {w1.dtype}, {w2.dtype}")


def takes_grouped(w1: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor | None, num_pairs: int) -> bool:
    """Whether `moe_apply_auto` runs the grouped GEMM for a call of ``num_pairs`` pairs."""
    dtypes = (torch.float32, *_TENSOR_CORE_DTYPES)
    return num_pairs >= GROUPED_MIN_PAIRS and w1_scale is None and w1.dtype in dtypes and w2.dtype in dtypes


def _moe_apply_grouped(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fp32_out: bool,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], invalid [1] int64)``: the MLP, and how many ids were outside ``[-1, N)``."""
    tokens, top_k = topk_ids.shape
    hidden_size, num_experts = w2.shape[1], w1.shape[0]
    device, pairs = hidden.device, tokens * top_k
    invalid = torch.zeros(1, dtype=torch.int64, device=device)
    out_dtype = torch.float32 if fp32_out else hidden.dtype
    if pairs == 0:  # nothing chosen: the mixture of no expert is zero
        return torch.zeros(tokens, hidden_size, dtype=out_dtype, device=device), invalid
    ids = topk_ids.contiguous()
    part = torch.empty(pairs, hidden_size, dtype=torch.float32, device=device)
    out = torch.empty(tokens, hidden_size, dtype=out_dtype, device=device)
    with on_device(device):
        launch_grouped_pairs(hidden, w1, w2, ids, topk_weights.contiguous(), part, True,
                             (block_m, block_n, block_k, num_warps, num_stages))  # fmt: skip
        launch_sum(part, ids, invalid, out, num_experts)
    return out, invalid


def launch_grouped_pairs(
    hidden, w1, w2, ids, weights, part, write_all: bool, tiles: tuple[int, ...], landing=None
) -> None:
    """Route, gate_up, down: ``part[t*K + k]`` = weighted expert output for ids in
    ``[0, N)``; other rows get zeros (``write_all``) or stay as they were (a later pass).
    With ``landing`` (`expertcache.result.Landing`) gate_up waits for each slot to land."""
    block_m, block_n, block_k, num_warps, num_stages = tiles
    tokens, top_k = ids.shape
    hidden_size, inter_size, num_experts = w2.shape[1], w2.shape[2], w1.shape[0]
    device, pairs = hidden.device, tokens * top_k
    routing = sort_pairs_by_expert(ids, num_experts, block_m)
    num_blocks = routing.expert_of_block.numel()
    # 16-bit operands only where both are the weights' dtype; anything mixed multiplies in fp32.
    fp32_gate_up = w1.dtype not in _TENSOR_CORE_DTYPES or hidden.dtype != w1.dtype
    act_dtype = w2.dtype if w2.dtype in _TENSOR_CORE_DTYPES else torch.float32
    act = torch.empty(num_blocks * block_m, inter_size, dtype=act_dtype, device=device)
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, block_n))](
        hidden, w1, routing.pair_of_row, routing.expert_of_block, act,
        hidden_size, inter_size, top_k, pairs, num_experts, hidden.stride(0), w1.stride(0), w1.stride(1),
        *landing_args(landing, ids), FP32_DOT=fp32_gate_up, WAIT=landing is not None, **launch,
    )  # fmt: skip
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
        act, w2, routing.pair_of_row, routing.expert_of_block, weights, part,
        hidden_size, inter_size, pairs, num_experts, w2.stride(0), w2.stride(1),
        FP32_DOT=act_dtype == torch.float32, WRITE_ALL=write_all, **launch,
    )  # fmt: skip


_moe_apply_grouped_op = torch.library.custom_op("expertcache::moe_apply_grouped", _moe_apply_grouped, mutates_args=())


@_moe_apply_grouped_op.register_fake
def _(hidden, w1, w2, topk_weights, topk_ids, fp32_out, block_m, block_n, block_k, num_warps, num_stages):
    dtype = torch.float32 if fp32_out else hidden.dtype
    return hidden.new_empty(topk_ids.shape[0], w2.shape[1], dtype=dtype), hidden.new_empty(1, dtype=torch.int64)
