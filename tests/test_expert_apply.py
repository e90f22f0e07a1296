"""The slot-indexed apply kernels equal the reference MoE, and slots equal full weights."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA, devices
from helpers import random_topk, random_weights

from expertcache import CachedWeightProvider
from expertcache.kernels import moe_apply
from expertcache.reference import moe_forward

# dtype travels with its tolerance: fp32 accumulation order differs from torch's matmul.
DTYPES = {"cpu": (torch.float32, 1e-5), "cuda": (torch.bfloat16, 2e-2)}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "tokens, top_k, num_experts, hidden, inter",
    [
        (1, 1, 1, 16, 16),  # one expert, top-1
        (1, 8, 16, 48, 40),  # decode; H, I not multiples of the blocks
        (3, 7, 7, 32, 24),  # K = E, prime E
        (5, 2, 11, 300, 20),  # H spans several column blocks, and several down programs (interpreted: 128 rows each)
        (2, 2, 3, 40, 200),  # I spans several gate_up programs, also interpreted
    ],
)
def test_moe_apply_matches_reference(device, tokens, top_k, num_experts, hidden, inter):
    dtype, tolerance = DTYPES[device]
    gen = torch.Generator().manual_seed(tokens + 10 * top_k)
    w = {k: v.to(device) for k, v in random_weights(num_experts, hidden, inter, dtype=dtype, generator=gen).items()}
    ids = random_topk(tokens, top_k, num_experts, generator=gen).to(device)
    if top_k > 1:
        ids[0, -1] = -1  # a skipped choice contributes nothing
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    router = torch.rand(tokens, top_k, generator=gen).to(device)
    ours = moe_apply(x, w["w1"], w["w2"], router, ids)
    reference = moe_forward(x.float(), w["w1"].float(), w["w2"].float(), router, ids)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])
def test_slots_give_identical_outputs_to_full_weights(device, mode):
    dtype = DTYPES[device][0]
    gen = torch.Generator().manual_seed(2)
    weights = random_weights(12, 32, 24, dtype=dtype, generator=gen)
    full = {k: v.to(device) for k, v in weights.items()}
    provider = CachedWeightProvider(weights, cache_size=4, device=device, mode=mode)
    for _ in range(30):
        ids = random_topk(1, 4, 12, generator=gen).to(device)
        x = torch.randn(1, 32, generator=gen).to(device, dtype)
        router = torch.rand(1, 4, generator=gen).to(device)
        result = provider.prepare(ids)
        assert torch.equal(
            moe_apply(x, result.w1, result.w2, router, result.topk_ids),
            moe_apply(x, full["w1"], full["w2"], router, ids),
        )


@pytest.mark.parametrize("device", devices())
def test_moe_apply_rejects_bad_shapes(device):
    w = {k: v.to(device) for k, v in random_weights(4, 16, 8).items()}
    ids, router = torch.zeros(1, 2, dtype=torch.long, device=device), torch.rand(1, 2, device=device)
    with pytest.raises(ValueError, match="disagree"):
        moe_apply(torch.randn(1, 8, device=device), w["w1"], w["w2"], router, ids)
    with pytest.raises(TypeError, match="floating point"):
        moe_apply(torch.ones(1, 16, dtype=torch.long, device=device), w["w1"], w["w2"], router, ids)
    with pytest.raises(ValueError, match="is on meta"):
        moe_apply(torch.randn(1, 16, device=device), w["w1"], w["w2"].to("meta"), router, ids)
    with pytest.raises(ValueError, match="contiguous"):
        moe_apply(torch.randn(1, 16, device=device), w["w1"].transpose(1, 2).contiguous().transpose(1, 2), w["w2"],
                  router, ids)  # fmt: skip


def dequantize(weights: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``weights * scale of its block``, the reference for block-scaled weights."""
    expanded = scales.repeat_interleave(block, 1).repeat_interleave(block, 2)
    return weights.float() * expanded[:, : weights.shape[1], : weights.shape[2]]


# (weight dtype, device) and its tolerance; fp8 e4m3 needs the GPU.
SCALED = [
    pytest.param(torch.float16, "cuda" if HAS_CUDA else "cpu", 1e-3, id="fp16"),
    pytest.param(torch.float8_e4m3fn, "cuda", 1e-4, id="fp8-cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("weight_dtype, device, tolerance", SCALED)
def test_block_scaled_weights_match_dequantized_reference(weight_dtype, device, tolerance):
    """DeepSeek-style block scales; H, I not multiples of the block (ragged last blocks)."""
    gen = torch.Generator().manual_seed(9)
    experts, hidden, inter, block = 6, 40, 24, 16
    w = random_weights(experts, hidden, inter, generator=gen)
    w1, w2 = w["w1"].to(weight_dtype), w["w2"].to(weight_dtype)
    w1_scale = torch.rand(experts, -(-2 * inter // block), -(-hidden // block), generator=gen) + 0.5
    w2_scale = torch.rand(experts, -(-hidden // block), -(-inter // block), generator=gen) + 0.5
    ids = random_topk(3, 4, experts, generator=gen)
    x = torch.randn(3, hidden, generator=gen)
    router = torch.rand(3, 4, generator=gen)
    on = [t.to(device) for t in (x, w1, w2, router, ids, w1_scale, w2_scale)]
    ours = moe_apply(*on[:5], w1_scale=on[5], w2_scale=on[6], scale_block=block)
    reference = moe_forward(x, dequantize(w1, w1_scale, block), dequantize(w2, w2_scale, block), router, ids)
    torch.testing.assert_close(ours.cpu(), reference, atol=tolerance, rtol=tolerance)
