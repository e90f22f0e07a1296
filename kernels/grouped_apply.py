"""Expert apply for calls of many tokens: a slot-indexed grouped GEMM on tensor cores.

``moe_apply_grouped`` computes what `moe_apply` computes (same arguments, same result up to
fp32 summation order) for calls where many (token, choice) pairs share an expert, so that
each expert's weights are read once per block of ``BLOCK_M`` rows instead of once per pair.
``w1``/``w2`` may be all-resident ``[E, ...]`` weights or a slot pool ``[S, ...]``; pairs are
grouped by the index they carry, so both give the same rows in the same blocks. Steps, with
``P = T*K`` pairs and ``N`` weight rows (experts or slots); no host sync, fixed shapes::

    route    torch ops: stable sort of pair ids by bucket (id if 0 <= id < N, else N), each
             bucket padded to BLOCK_M rows -> pair_of_row [R], expert_of_block [R/BLOCK_M]
    gate_up  grid (R/BLOCK_M, I/BLOCK_N):  act[r]  = silu(x_t @ W1g[e].T) * (x_t @ W1u[e].T)
    down     grid (R/BLOCK_M, H/BLOCK_N):  part[p] = topk_weight[p] * (act[r] @ W2[e].T)  fp32
    sum_k    `expert_apply._sum_over_k_kernel`: out[t] = sum over k of part[t, k], in k order

Blocks past the used ones exit at once; the blocks of bucket N (ids that contribute nothing)
write zero rows of ``part`` and read no weights. ``act`` is fp32 for fp32 ``w2``, else
rounded to ``w2``'s dtype so the down GEMM runs on tensor cores (as fused MoE kernels do;
`moe_apply` keeps it fp32). fp32 operands multiply with ``input_precision="ieee"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import on_device
from expertcache.kernels.expert_apply import _check, _check_scales, _sum_over_k_kernel, moe_apply

#: Pairs (``T*K``) from which `moe_apply_auto` takes the grouped GEMM over the GEMV. A
#: placeholder: set it from the crossover that benchmarks/bench_apply.py measures.
GROUPED_MIN_PAIRS = 64

_TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)
_NUM_WARPS, _NUM_STAGES = 4, 3  # ignored by the interpreter


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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if (expert < 0) | (expert >= num_experts):  # past the used blocks, or pairs that contribute nothing
        return
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
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if expert < 0:
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


@dataclass(frozen=True)
class GroupedRouting:
    """Where each (token, choice) pair sits in the bucket-sorted, block-padded row space.

    Attributes:
        pair_of_row: ``[num_blocks * block_m]`` int64, the flat pair index ``t*K + k`` each
            row holds, ``T*K`` for padding. Every valid pair appears once; the pairs of one
            bucket fill its blocks in their original order (stable sort), padding last.
        expert_of_block: ``[num_blocks]`` int64, the index into ``w1``/``w2`` (expert or
            slot) of every row of the block; ``N`` for a block of pairs whose id is outside
            ``[0, N)``; ``-1`` for blocks past the used ones. Used blocks come first.
        block_m: rows per block.
    """

    pair_of_row: torch.Tensor
    expert_of_block: torch.Tensor
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks `sort_pairs_by_expert` uses, from shapes alone.

    With ``m <= min(N + 1, P)`` non-empty buckets (``N`` experts and the invalid bucket)
    holding ``P`` pairs: each block holds at least one pair (``<= P``); each bucket pads by
    at most ``block_m - 1`` rows (``<= (P + m (block_m - 1)) / block_m``).
    """
    buckets = min(num_experts + 1, num_pairs)
    return min(num_pairs, (num_pairs + buckets * (block_m - 1)) // block_m)


def sort_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> GroupedRouting:
    """Group the (token, choice) pairs of ``topk_ids`` ``[T, K]`` by id into blocks of ``block_m``.

    Torch ops on ``topk_ids``' device, fixed output shapes, no host sync (CUDA-graph capturable).
    """
    ids = topk_ids.reshape(-1).long()
    num_pairs, device = ids.numel(), ids.device
    bucket = ids.masked_fill((ids < 0) | (ids >= num_experts), num_experts)
    sorted_bucket, order = torch.sort(bucket, stable=True)
    first = torch.searchsorted(sorted_bucket, torch.arange(num_experts + 2, device=device))  # bucket starts, [N+2]
    blocks = (first[1:] - first[:-1] + block_m - 1) // block_m  # [N+1]
    block_end = torch.cumsum(blocks, 0)
    rank = torch.arange(num_pairs, device=device) - first[sorted_bucket]
    row = (block_end - blocks)[sorted_bucket] * block_m + rank
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    pair_of_row = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    pair_of_row.scatter_(0, row, order)
    expert_of_block = torch.searchsorted(block_end, torch.arange(num_blocks, device=device), right=True)
    return GroupedRouting(pair_of_row, expert_of_block.masked_fill(expert_of_block > num_experts, -1), block_m)


def default_blocks(num_pairs: int, hidden_size: int, inter_size: int, tensor_cores: bool) -> tuple[int, int, int]:
    """``(block_m, block_n, block_k)`` from shapes alone, never from the number of weight rows,
    so a slot pool and all-resident weights tile the same rows the same way."""
    block_m = 16 if num_pairs < 4096 else 32 if num_pairs < 16384 else 64
    block_n = min(64, max(16, triton.next_power_of_2(min(hidden_size, inter_size))))
    block_k = min(64 if tensor_cores else 32, max(16, triton.next_power_of_2(min(hidden_size, inter_size))))
    return block_m, block_n, block_k


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
        block_m, block_n, block_k: tile sizes (powers of two, at least 16); None: `default_blocks`.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype (fp32 with ``fp32_out``), accumulated in fp32 and
        summed over k in k order (deterministic). Products are fp32 with 16-bit rounding of
        the intermediate when ``w2`` is fp16/bf16 (see the module docstring).

    A ``torch.library`` custom op (``expertcache::moe_apply_grouped``); no host sync.
    """
    _check(hidden, w1, w2, topk_weights, topk_ids)
    _check_scales(w1, w2, w1_scale, w2_scale, scale_block)
    if w1_scale is not None:
        raise NotImplementedError("moe_apply_grouped has no block scales yet: use moe_apply (or moe_apply_auto)")
    if w1.dtype not in (torch.float32, *_TENSOR_CORE_DTYPES) or w2.dtype not in (torch.float32, *_TENSOR_CORE_DTYPES):
        raise NotImplementedError(f"moe_apply_grouped takes fp32/fp16/bf16 weights, got {w1.dtype}, {w2.dtype}")
    _check_counter(invalid_ids, hidden.device)
    defaults = default_blocks(topk_ids.numel(), w2.shape[1], w2.shape[2], w1.dtype in _TENSOR_CORE_DTYPES)
    blocks = tuple(given or default for given, default in zip((block_m, block_n, block_k), defaults, strict=True))
    for name, size in zip(("block_m", "block_n", "block_k"), blocks, strict=True):
        if not isinstance(size, int) or size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two of at least 16 (tl.dot's smallest tile), got {size!r}")
    # Eagerly the implementation runs directly (the dispatcher costs ~10 us a call).
    run = torch.ops.expertcache.moe_apply_grouped if torch.compiler.is_compiling() else _moe_apply_grouped
    out, invalid = run(hidden, w1, w2, topk_weights, topk_ids, fp32_out, *blocks)
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
    grouped = (
        topk_ids.numel() >= GROUPED_MIN_PAIRS
        and w1_scale is None
        and w1.dtype in (torch.float32, *_TENSOR_CORE_DTYPES)
        and w2.dtype in (torch.float32, *_TENSOR_CORE_DTYPES)
    )
    apply = moe_apply_grouped if grouped else moe_apply
    return apply(hidden, w1, w2, topk_weights, topk_ids, w1_scale=w1_scale, w2_scale=w2_scale,
                 scale_block=scale_block, invalid_ids=invalid_ids, fp32_out=fp32_out)  # fmt: skip


def _check_counter(invalid_ids: torch.Tensor | None, device: torch.device) -> None:
    if invalid_ids is not None and (
        invalid_ids.dtype != torch.int64 or invalid_ids.numel() != 1 or invalid_ids.device != device
    ):
        raise ValueError(f"invalid_ids must be a [1] int64 counter on {device}")


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], invalid [1] int64)``: the MLP, and how many ids were outside ``[-1, N)``."""
    tokens, top_k = topk_ids.shape
    hidden_size, inter_size, num_experts = w2.shape[1], w2.shape[2], w1.shape[0]
    device, pairs = hidden.device, tokens * top_k
    invalid = torch.zeros(1, dtype=torch.int64, device=device)
    out_dtype = torch.float32 if fp32_out else hidden.dtype
    if pairs == 0:  # nothing chosen: the mixture of no expert is zero
        return torch.zeros(tokens, hidden_size, dtype=out_dtype, device=device), invalid
    ids = topk_ids.contiguous()
    routing = sort_pairs_by_expert(ids, num_experts, block_m)
    num_blocks = routing.expert_of_block.numel()
    # 16-bit operands only where both are the weights' dtype; anything mixed multiplies in fp32.
    fp32_gate_up = w1.dtype not in _TENSOR_CORE_DTYPES or hidden.dtype != w1.dtype
    act_dtype = w2.dtype if w2.dtype in _TENSOR_CORE_DTYPES else torch.float32
    act = torch.empty(num_blocks * block_m, inter_size, dtype=act_dtype, device=device)
    part = torch.empty(pairs, hidden_size, dtype=torch.float32, device=device)
    out = torch.empty(tokens, hidden_size, dtype=out_dtype, device=device)
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
    with on_device(device):
        _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, block_n))](
            hidden, w1, routing.pair_of_row, routing.expert_of_block, act,
            hidden_size, inter_size, top_k, pairs, num_experts, hidden.stride(0), w1.stride(0), w1.stride(1),
            FP32_DOT=fp32_gate_up, **launch,
        )  # fmt: skip
        _down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
            act, w2, routing.pair_of_row, routing.expert_of_block, topk_weights.contiguous(), part,
            hidden_size, inter_size, pairs, num_experts, w2.stride(0), w2.stride(1),
            FP32_DOT=act_dtype == torch.float32, **launch,
        )  # fmt: skip
        _sum_over_k_kernel[(tokens, triton.cdiv(hidden_size, 256))](
            part, ids, invalid, out, hidden_size, top_k, num_experts, out.stride(0),
            BLOCK_H=256, BLOCK_K=max(2, triton.next_power_of_2(top_k)),
        )  # fmt: skip
    return out, invalid


_moe_apply_grouped_op = torch.library.custom_op("expertcache::moe_apply_grouped", _moe_apply_grouped, mutates_args=())


@_moe_apply_grouped_op.register_fake
def _(hidden, w1, w2, topk_weights, topk_ids, fp32_out, block_m, block_n, block_k):
    dtype = torch.float32 if fp32_out else hidden.dtype
    return hidden.new_empty(topk_ids.shape[0], w2.shape[1], dtype=dtype), hidden.new_empty(1, dtype=torch.int64)
