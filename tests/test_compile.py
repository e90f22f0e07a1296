"""``torch.compile(fullgraph=True)`` of an MoE layer calling ``provider.prepare`` (device mode).

The device-side work of ``prepare`` and the expert apply are ``torch.library`` custom ops
with fake implementations and declared mutations, so dynamo traces the whole layer with no
graph break and inductor keeps the cache's in-place updates (compared here with eager,
call after call, misses included).
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import random_weights

from expertcache import CachedWeightProvider, FullGPUProvider
from expertcache.kernels import moe_apply

E, H, INTER, K = 8, 16, 8, 2  # experts, hidden, intermediate, top-k


class MoEExperts(torch.nn.Module):
    """The routed-experts half of an MoE layer: weights and ids in, mixture out."""

    def __init__(self, provider) -> None:
        super().__init__()
        self.provider = provider

    def forward(self, hidden, topk_weights, topk_ids):
        result = self.provider.prepare(topk_ids)
        return moe_apply(hidden, result.w1, result.w2, topk_weights, result.topk_ids)


class MoELayer(MoEExperts):
    """Router included: softmax top-k, then the experts."""

    def __init__(self, provider, router: torch.Tensor) -> None:
        super().__init__(provider)
        self.router = router

    def forward(self, hidden):
        weights, ids = torch.topk(torch.softmax(hidden @ self.router, dim=-1), K, dim=-1)
        return super().forward(hidden, weights, ids)


def _pair(device, make):
    weights = random_weights(E, H, INTER, generator=torch.Generator().manual_seed(5))
    return [make(CachedWeightProvider(weights, cache_size=4, device=device, mode="device")) for _ in range(2)]


@pytest.mark.parametrize("device", devices())
def test_compiled_layer_traces_in_one_graph(device):
    router = torch.randn(H, E, generator=torch.Generator().manual_seed(1)).to(device)
    layer, _ = _pair(device, lambda p: MoELayer(p, router))
    with torch.no_grad():
        explanation = torch._dynamo.explain(layer)(torch.randn(1, H, device=device))
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize("device", devices())
def test_compiled_experts_equal_eager(device):
    torch._dynamo.reset()
    eager, compiled_module = _pair(device, MoEExperts)
    compiled = torch.compile(compiled_module, fullgraph=True)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for step in range(10):
            ids = torch.rand(2, E, generator=gen).topk(K, dim=-1).indices.to(device)
            hidden = torch.randn(2, H, generator=gen).to(device)
            router = torch.rand(2, K, generator=gen).to(device)
            assert torch.equal(compiled(hidden, router, ids), eager(hidden, router, ids)), step
    assert compiled_module.provider.stats == eager.provider.stats
    assert compiled_module.provider.stats.misses > 4  # misses and evictions happened inside
    assert compiled_module.provider.resident() == eager.provider.resident()


@pytest.mark.parametrize("device", devices())
def test_compiled_layer_with_router_matches_eager(device):
    """Inductor fuses the softmax differently (last-ulp differences); routing and state agree."""
    torch._dynamo.reset()
    router = torch.randn(H, E, generator=torch.Generator().manual_seed(1)).to(device)
    eager, compiled_module = _pair(device, lambda p: MoELayer(p, router))
    compiled = torch.compile(compiled_module, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(6):
            hidden = torch.randn(1, H, generator=gen).to(device)
            torch.testing.assert_close(compiled(hidden), eager(hidden), atol=1e-5, rtol=1e-5)
    assert compiled_module.provider.stats == eager.provider.stats


@pytest.mark.parametrize("device", devices())
def test_compiled_full_provider_with_an_expert_map(device):
    """The EP passthrough (remap op) compiles without a graph break and equals eager."""
    torch._dynamo.reset()
    weights = {k: v.to(device) for k, v in random_weights(3, H, INTER).items()}
    expert_map = torch.tensor([-1, 0, -1, 2, 1, -1, -1, -1], dtype=torch.int32, device=device)
    layer = MoEExperts(FullGPUProvider(weights, expert_map=expert_map))
    compiled = torch.compile(layer, fullgraph=True)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.rand(2, E, generator=gen).topk(K, dim=-1).indices.to(device)
            hidden, router = torch.randn(2, H, generator=gen).to(device), torch.rand(2, K, generator=gen).to(device)
            assert torch.equal(compiled(hidden, router, ids), layer(hidden, router, ids))
