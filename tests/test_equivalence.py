"""End to end: the reference MoE on a provider's slots equals it on the full weights.

On the CPU in fp32 the results are bit-identical; on a GPU in bf16 they agree within the
dtype's tolerance. After every call each resident expert's slot holds its rows byte for byte.
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import random_topk, random_weights

from expertcache import CachedWeightProvider, FullGPUProvider
from expertcache.reference import moe_forward

# (tokens, top_k, num_experts, cache_size) and the edge each covers.
SHAPES = [
    pytest.param(1, 2, 8, 3, id="T=1 decode"),
    pytest.param(5, 7, 7, 7, id="K=E, prime E, cache=E"),
    pytest.param(3, 2, 13, 6, id="prime E"),
    pytest.param(1, 1, 6, 1, id="cache_size=1 with K=1"),
    pytest.param(2, 3, 10, 10, id="cache_size=E"),
]

# dtype and the tolerance it brings: exact in fp32 on the CPU.
DTYPES = {
    "cpu": (torch.float32, 0.0, 0.0),
    "cuda": (torch.bfloat16, 2e-2, 2e-2),
}

CALLS = 200


def check_slots_hold_their_experts(provider, weights, result):
    for expert in provider.resident():
        slot = provider.slot_of(expert)
        assert provider.expert_in(slot) == expert
        for name in weights:
            held = getattr(result, name, None)
            held = result.extra[name] if held is None else held
            as_bytes = [t.cpu().reshape(-1).view(torch.uint8) for t in (held[slot], weights[name][expert])]
            assert torch.equal(*as_bytes)


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tokens, top_k, num_experts, cache_size", SHAPES)
def test_cached_equals_full_weights(device, mode, tokens, top_k, num_experts, cache_size):
    dtype, atol, rtol = DTYPES[device]
    gen = torch.Generator().manual_seed(num_experts * 100 + cache_size)
    weights = random_weights(num_experts, 16, 8, dtype=dtype, generator=gen, extras=True)
    provider = CachedWeightProvider(weights, cache_size=cache_size, device=device, mode=mode)
    full = {name: t.to(device) for name, t in weights.items()}
    for _ in range(CALLS):
        ids = random_topk(tokens, top_k, num_experts, generator=gen).to(device)
        hidden = torch.randn(tokens, 16, generator=gen).to(dtype).to(device)
        router = torch.rand(tokens, top_k, generator=gen).to(device)
        result = provider.prepare(ids)
        ours = moe_forward(hidden, result.w1, result.w2, router, result.topk_ids)
        reference = moe_forward(hidden, full["w1"], full["w2"], router, ids)
        torch.testing.assert_close(ours, reference, atol=atol, rtol=rtol)
        check_slots_hold_their_experts(provider, weights, result)
    stats = provider.stats
    assert stats.calls == CALLS
    assert stats.bytes_h2d == stats.misses * provider.pool.layout.expert_bytes
    if cache_size == num_experts:
        assert stats.evictions == 0 and stats.misses <= num_experts


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("device", devices())
def test_expert_map_serves_only_local_experts(device, mode):
    """EP: a rank owning experts {1, 4, 6} of 8 loads only those; others come out -1."""
    gen = torch.Generator().manual_seed(3)
    local_global = [6, 1, 4]  # local index -> global id
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[local_global] = torch.arange(3, dtype=torch.int32)
    full = random_weights(8, 16, 8, generator=gen)
    local = {name: t[local_global] for name, t in full.items()}
    provider = CachedWeightProvider(local, cache_size=2, device=device, expert_map=expert_map, mode=mode)
    passthrough = FullGPUProvider({n: t.to(device) for n, t in local.items()}, expert_map=expert_map.to(device))
    for _ in range(CALLS):
        ids = random_topk(1, 2, 8, generator=gen).to(device)
        hidden = torch.randn(1, 16, generator=gen).to(device)
        router = torch.rand(1, 2, generator=gen).to(device)
        result = provider.prepare(ids)
        ours = moe_forward(hidden, result.w1, result.w2, router, result.topk_ids)
        # the rank's share of the output: only local experts contribute
        masked = torch.where(expert_map.to(device)[ids] >= 0, ids, -1)
        reference = moe_forward(hidden, full["w1"].to(device), full["w2"].to(device), router, masked)
        assert torch.equal(ours, reference)
        assert torch.equal(result.topk_ids < 0, masked < 0)
        assert provider.resident() <= {0, 1, 2}
        pt = passthrough.prepare(ids)
        assert torch.equal(moe_forward(hidden, pt.w1, pt.w2, router, pt.topk_ids), reference)


def test_full_gpu_provider_is_a_passthrough():
    weights = random_weights(4, 8, 4, extras=True)
    provider = FullGPUProvider(weights)
    ids = torch.tensor([[0, 3]])
    result = provider.prepare(ids)
    assert result.topk_ids is ids
    assert result.w1 is weights["w1"] and result.w2 is weights["w2"]
    assert result.w1_scale is weights["w1_scale"] and result.w2_scale is weights["w2_scale"]
    assert result.extra == {"bias": weights["bias"]}
