"""The grouped-GEMM apply equals the reference MoE and the GEMV apply; its routing is exact.

Interpreted on a CPU (fp32, fp16), compiled on a GPU (fp32 with ieee products, and bf16 at
Qwen3-30B-A3B shapes, inside a CUDA graph too). Weights sit between poisoned (NaN) experts,
so a kernel that read outside ``[0, N)`` would give NaN.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import devices
from helpers import random_topk, random_weights

from expertcache.kernels import grouped_apply as grouped_module
from expertcache.kernels import moe_apply, moe_apply_grouped, moe_apply_torch
from expertcache.kernels.grouped_apply import moe_apply_auto
from expertcache.kernels.grouped_routing import (
    GroupedRouting,
    SortLaunch,
    max_blocks,
    sort_launch,
    sort_pairs_by_expert,
    sort_pairs_by_expert_torch,
)

# dtype travels with its tolerance: fp32 differs from torch in summation order only; fp16
# rounds the intermediate activation to fp16 as well.
DTYPES = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.float16, 4e-3, id="fp16")]


def poisoned_weights(num_experts, hidden, inter, *, dtype, device, gen):
    """``w1``, ``w2`` as views into buffers whose experts -1 and N are NaN."""
    w = random_weights(num_experts, hidden, inter, generator=gen)
    views = []
    for tensor in (w["w1"], w["w2"]):
        buffer = torch.full((num_experts + 2, *tensor.shape[1:]), float("nan"))
        buffer[1:-1] = tensor
        views.append(buffer.to(device, dtype)[1:-1])
    return views


def inputs(tokens, top_k, num_experts, hidden, inter, *, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = poisoned_weights(num_experts, hidden, inter, dtype=dtype, device=device, gen=gen)
    ids = random_topk(tokens, top_k, num_experts, generator=gen).to(device)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    router = torch.rand(tokens, top_k, generator=gen).to(device)
    return x, w1, w2, router, ids


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize(
    "tokens, top_k, num_experts, hidden, inter",
    [
        (1, 1, 1, 16, 16),  # one token, one expert, top-1
        (1, 6, 6, 32, 16),  # T=1, K=N: one row in each of N blocks
        (7, 5, 5, 48, 40),  # K=N, prime N: every token in every expert
        (40, 3, 6, 33, 17),  # H, I odd (ragged tiles); several blocks per expert
        (17, 2, 5, 70, 24),  # H spans several K steps, the last one ragged
    ],
)
def test_grouped_matches_reference(device, dtype, tolerance, tokens, top_k, num_experts, hidden, inter):
    x, w1, w2, router, ids = inputs(tokens, top_k, num_experts, hidden, inter, dtype=dtype, device=device)
    ours = moe_apply_grouped(x, w1, w2, router, ids)
    assert ours.dtype == dtype and ours.shape == (tokens, hidden)
    reference = moe_apply_torch(x, w1, w2, router, ids)
    torch.testing.assert_close(ours.float(), reference.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_bad_ids_contribute_nothing_and_are_counted(device, id_dtype):
    x, w1, w2, router, ids = inputs(9, 4, 6, 32, 16, device=device, seed=1)
    ids = ids.to(id_dtype)
    ids[0, 0], ids[1, 3], ids[2, 1], ids[4, 2] = -1, -4, 6, -1  # skip; below -1; one past the end; skip
    if id_dtype == torch.int64:
        ids[3, 0] = 2**32 + 3  # expert 3 in the low 32 bits: must not be read as 3
    invalid = torch.full((1,), 5, dtype=torch.int64, device=device)  # the counter adds to what it holds
    ours = moe_apply_grouped(x, w1, w2, router, ids, invalid_ids=invalid)
    torch.testing.assert_close(ours, moe_apply_torch(x, w1, w2, router, ids), atol=1e-5, rtol=1e-5)
    assert int(invalid) == 5 + (3 if id_dtype == torch.int64 else 2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fill, counted", [(-1, 0), (-4, 24)], ids=["all skipped", "all invalid"])
def test_no_valid_id_gives_zeros(device, fill, counted):
    x, w1, w2, router, ids = inputs(8, 3, 6, 32, 16, device=device)
    invalid = torch.zeros(1, dtype=torch.int64, device=device)
    out = moe_apply_grouped(x, w1, w2, router, torch.full_like(ids, fill), invalid_ids=invalid)
    assert torch.equal(out, torch.zeros_like(x)) and int(invalid) == counted


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tokens, top_k", [(0, 4), (3, 0)], ids=["T=0", "K=0"])
@pytest.mark.parametrize("fp32_out", [False, True])
def test_no_pairs_give_zeros(device, tokens, top_k, fp32_out):
    _, w1, w2, _, _ = inputs(1, 1, 4, 32, 16, dtype=torch.float16, device=device)
    x = torch.randn(tokens, 32, device=device, dtype=torch.float16)
    ids = torch.zeros(tokens, top_k, dtype=torch.int64, device=device)
    out = moe_apply_grouped(x, w1, w2, torch.rand(tokens, top_k, device=device), ids, fp32_out=fp32_out)
    assert out.dtype == (torch.float32 if fp32_out else torch.float16)
    assert out.shape == (tokens, 32) and not out.any()


@pytest.mark.parametrize("device", devices())
def test_fp32_out_is_the_accumulator_rounded_once(device):
    x, w1, w2, router, ids = inputs(12, 3, 6, 40, 24, dtype=torch.float16, device=device, seed=2)
    wide = moe_apply_grouped(x, w1, w2, router, ids, fp32_out=True)
    narrow = moe_apply_grouped(x, w1, w2, router, ids)
    assert wide.dtype == torch.float32 and narrow.dtype == torch.float16
    assert torch.equal(narrow, wide.half())
    reference = moe_apply_torch(x.float(), w1.float(), w2.float(), router, ids)  # fp32 from the same fp16 values
    torch.testing.assert_close(wide, reference, atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("device", devices())
def test_slot_pool_gives_identical_outputs_to_full_weights(device):
    """A pool of 4 slots holding 4 of 12 experts; the same routing in both index spaces."""
    x, w1, w2, router, _ = inputs(20, 3, 12, 32, 16, device=device, seed=3)
    gen = torch.Generator().manual_seed(3)
    slot_to_expert = torch.randperm(12, generator=gen)[:4].to(device)
    slot_ids = random_topk(20, 3, 4, generator=gen).to(device)
    slot_ids[0, 0] = -1
    expert_ids = torch.where(slot_ids >= 0, slot_to_expert[slot_ids], -1)
    pool = moe_apply_grouped(x, w1[slot_to_expert], w2[slot_to_expert], router, slot_ids)
    assert torch.equal(pool, moe_apply_grouped(x, w1, w2, router, expert_ids))
    torch.testing.assert_close(pool, moe_apply_torch(x, w1, w2, router, expert_ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", devices())
def test_duplicate_ids_within_a_token(device):
    x, w1, w2, router, _ = inputs(3, 4, 6, 32, 16, device=device, seed=4)
    ids = torch.tensor([[2, 2, 2, 2], [0, 5, 0, 5], [1, 3, 1, -1]], device=device)
    ours = moe_apply_grouped(x, w1, w2, router, ids)
    torch.testing.assert_close(ours, moe_apply_torch(x, w1, w2, router, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", devices())
def test_grouped_equals_gemv(device):
    x, w1, w2, router, ids = inputs(33, 4, 7, 48, 24, device=device, seed=5)
    ids[::5, 1] = -1
    ids[3, 3] = 9
    counters = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(2)]
    grouped = moe_apply_grouped(x, w1, w2, router, ids, invalid_ids=counters[0])
    gemv = moe_apply(x, w1, w2, router, ids, invalid_ids=counters[1])
    torch.testing.assert_close(grouped, gemv, atol=1e-5, rtol=1e-5)
    assert int(counters[0]) == int(counters[1]) == 1


def routing_by_hand(ids: list[int], num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """`sort_pairs_by_expert` in plain Python: bucket by bucket, pairs in order, padded to blocks."""
    pairs = len(ids)
    rows, experts = [], []
    for bucket in range(num_experts + 1):
        members = [p for p, e in enumerate(ids) if (e if 0 <= e < num_experts else num_experts) == bucket]
        while members:
            block, members = members[:block_m], members[block_m:]
            rows += block + [pairs] * (block_m - len(block))
            experts.append(bucket)
    unused = max_blocks(pairs, num_experts, block_m) - len(experts)
    return rows + [pairs] * (unused * block_m), experts + [-1] * unused


def sort_in_one_program(ids: torch.Tensor, num_experts: int, block_m: int) -> GroupedRouting:
    """The one-program sort of a call of one chunk; past one chunk, its refusal is asserted
    and the default launch sorts."""
    if sort_launch(ids.numel(), num_experts).num_chunks > 1:
        with pytest.raises(ValueError, match="one_program sorts a call of one chunk"):
            sort_pairs_by_expert(ids, num_experts, block_m, one_program=True)
        return sort_pairs_by_expert(ids, num_experts, block_m)
    return sort_pairs_by_expert(ids, num_experts, block_m, one_program=True)


ROUTES = [
    pytest.param(sort_pairs_by_expert, id="kernel"),  # the default launch
    pytest.param(sort_in_one_program, id="one-program"),
    pytest.param(functools.partial(sort_pairs_by_expert, one_program=False, num_warps=2), id="per-chunk"),
    pytest.param(sort_pairs_by_expert_torch, id="torch"),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "ids, num_experts, bound",
    [
        ([[3, 1], [1, -1], [7, 1], [-4, 0]], 5, 6),  # skips, out of range, a bucket of 3
        ([[0, 1, 2, 3, 4, 5]], 8, 6),  # every pair its own expert: the bound of P blocks is reached
        ([[2]] * 37, 4, 7),  # one expert, 37 rows: three blocks, the last one padded
        ([[-1, -1]] * 3, 2, 3),  # only the invalid bucket
        ([[(7 * p) % 9 - 2] for p in range(300)], 5, 24),  # three chunks of 128 pairs, the last one ragged
        ([[(37 * p) % 1003 - 2, p] for p in range(40)], 1000, 80),  # N = 1000: five chunks of 16 pairs
    ],
)
def test_routing_equals_plain_python(device, route, ids, num_experts, bound):
    block_m = 16
    assert max_blocks(len(ids) * len(ids[0]), num_experts, block_m) == bound
    routing = route(torch.tensor(ids, device=device), num_experts, block_m)
    rows, experts = routing_by_hand(sum(ids, []), num_experts, block_m)
    assert routing.pair_of_row.tolist() == rows
    assert routing.expert_of_block.tolist() == experts


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("one_program", [None, True, False])
@pytest.mark.parametrize(
    "tokens, top_k, num_experts, block_m", [(200, 8, 32, 16), (64, 4, 128, 64), (9, 3, 2, 32), (16, 8, 64, 16)]
)
def test_routing_kernel_equals_torch_reference(device, one_program, tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-2, num_experts + 2, (tokens, top_k), generator=gen).to(device, torch.int32)
    sort = sort_in_one_program if one_program else functools.partial(sort_pairs_by_expert, one_program=one_program)
    kernel = sort(ids, num_experts, block_m)
    reference = sort_pairs_by_expert_torch(ids, num_experts, block_m)
    assert torch.equal(kernel.pair_of_row, reference.pair_of_row)
    assert torch.equal(kernel.expert_of_block, reference.expert_of_block)


def test_pair_sort_launches_as_measured():
    """One program for a call of one chunk (a decode batch up to 16 tokens at top-8 over 64
    slots), one per chunk past it; 8 warps."""
    assert sort_launch(128, 64) == SortLaunch(num_bins=128, chunk=128, num_chunks=1, one_program=True, num_warps=8)
    assert sort_launch(129, 64) == SortLaunch(num_bins=128, chunk=128, num_chunks=2, one_program=False, num_warps=8)
    assert sort_launch(256, 32) == SortLaunch(num_bins=64, chunk=128, num_chunks=2, one_program=False, num_warps=8)
    assert sort_launch(64, 768) == SortLaunch(num_bins=1024, chunk=16, num_chunks=4, one_program=False, num_warps=8)
    assert sort_launch(1024, 64, num_warps=2, one_program=False) == (128, 128, 8, False, 2)
    assert sort_launch(128, 64, num_warps=2, one_program=True) == (128, 128, 1, True, 2)
    with pytest.raises(ValueError, match=r"one chunk \(128 pairs over 64 ids\), got 129 pairs"):
        sort_launch(129, 64, one_program=True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("route", ROUTES)
def test_block_bound_is_reached_not_passed(device, route):
    """Every bucket one row past a block multiple pads the most: the bound is reached, not passed."""
    for num_experts, block_m in ((5, 16), (40, 16), (3, 64)):
        ids = torch.arange(num_experts, device=device).repeat_interleave(block_m + 1).reshape(1, -1)
        routing = route(ids, num_experts, block_m)
        used = int((routing.expert_of_block >= 0).sum())
        assert used == routing.expert_of_block.numel() == 2 * num_experts


@pytest.mark.parametrize("device", devices())
def test_rejects_what_it_cannot_do(device):
    x, w1, w2, router, ids = inputs(2, 2, 4, 32, 16, device=device)
    scales = (torch.ones(4, 1, 1, device=device), torch.ones(4, 1, 1, device=device))
    with pytest.raises(NotImplementedError, match="block scales"):
        moe_apply_grouped(x, w1, w2, router, ids, w1_scale=scales[0], w2_scale=scales[1], scale_block=32)
    with pytest.raises(NotImplementedError, match="fp32/fp16/bf16"):
        moe_apply_grouped(x, w1.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn), router, ids)
    for bad in (0, 8, 24):
        with pytest.raises(ValueError, match="power of two"):
            moe_apply_grouped(x, w1, w2, router, ids, block_m=bad)
    for bad in (32.0, True):  # a whole float or a bool is no tile size; numpy's ints are
        with pytest.raises(TypeError, match="block_m must be a power of two"):
            moe_apply_grouped(x, w1, w2, router, ids, block_m=bad)
    torch.testing.assert_close(
        moe_apply_grouped(x, w1, w2, router, ids, block_m=np.int64(16)), moe_apply_grouped(x, w1, w2, router, ids)
    )
    with pytest.raises(ValueError, match="counter"):
        moe_apply_grouped(x, w1, w2, router, ids, invalid_ids=torch.zeros(1, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="disagree"):
        moe_apply_grouped(x[:, :16], w1, w2, router, ids)
    for bad in (0, 3, 64):  # the pair sort's warps: refused, never replaced by the default
        with pytest.raises(ValueError, match="num_warps must be a power of two from 1 to 32"):
            sort_pairs_by_expert(ids, 4, 16, num_warps=bad)
    for bad in (0, 1, "yes"):
        with pytest.raises(ValueError, match="one_program must be None, True or False"):
            sort_pairs_by_expert(ids, 4, 16, one_program=bad)


def test_auto_picks_the_gemv_for_small_calls_and_scales(monkeypatch):
    calls = []
    for name in ("moe_apply", "moe_apply_grouped"):
        monkeypatch.setattr(grouped_module, name, lambda *args, name=name, **kwargs: calls.append(name))
    threshold = grouped_module.GROUPED_MIN_PAIRS
    w1, w2 = torch.zeros(4, 32, 32), torch.zeros(4, 32, 16)
    for tokens, scaled, expected in ((1, False, "moe_apply"), (threshold, False, "moe_apply_grouped"),
                                     (threshold, True, "moe_apply")):  # fmt: skip
        scales = (torch.ones(4, 1, 1), torch.ones(4, 1, 1)) if scaled else (None, None)
        ids = torch.zeros(tokens, 1, dtype=torch.int64)
        moe_apply_auto(torch.zeros(tokens, 32), w1, w2, torch.ones(tokens, 1), ids, w1_scale=scales[0],
                       w2_scale=scales[1], scale_block=32)  # fmt: skip
        assert calls.pop() == expected


@pytest.mark.parametrize("device", devices())
def test_custom_op_passes_opcheck(device):
    """Schema, fake (meta) implementation and dispatch of ``expertcache::moe_apply_grouped``."""
    x, w1, w2, router, ids = inputs(5, 2, 4, 32, 16, device=device, seed=9)
    ids[0, 1] = -1
    torch.library.opcheck(
        torch.ops.expertcache.moe_apply_grouped.default, (x, w1, w2, router, ids, False, 16, 16, 16, 4, 3)
    )


@pytest.mark.gpu
def test_qwen3_shape_bf16_matches_reference():
    """Qwen3-30B-A3B expert shapes over a pool of 32 slots, 64 tokens: several blocks per slot."""
    x, w1, w2, router, ids = inputs(64, 8, 32, 2048, 768, dtype=torch.bfloat16, device="cuda", seed=6)
    ids[5, 2] = -1
    ours = moe_apply_grouped(x, w1, w2, router, ids)
    reference = moe_apply_torch(x, w1, w2, router, ids)
    torch.testing.assert_close(ours.float(), reference.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours.float(), moe_apply(x, w1, w2, router, ids).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_ids_equal_eager():
    x, w1, w2, router, ids = inputs(48, 4, 16, 256, 128, dtype=torch.bfloat16, device="cuda", seed=7)
    static_ids, invalid = ids.clone(), torch.zeros(1, dtype=torch.int64, device="cuda")
    moe_apply_grouped(x, w1, w2, router, static_ids)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_apply_grouped(x, w1, w2, router, static_ids, invalid_ids=invalid)
    gen = torch.Generator().manual_seed(8)
    for step in range(4):
        new_ids = random_topk(48, 4, 16, generator=gen).cuda()
        new_ids[step, 0] = -1 if step % 2 else 16  # a skip, or an id one past the end (counted)
        static_ids.copy_(new_ids)
        invalid.zero_()
        graph.replay()
        eager = moe_apply_grouped(x, w1, w2, router, new_ids)
        assert torch.equal(static_out, eager)
        assert int(invalid) == (0 if step % 2 else 1)
