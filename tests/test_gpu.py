"""GPU-only checks: real pinned memory and its lifetime, the device guard, and a whole decode
step replayed in a CUDA graph."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import random_topk, random_weights

from expertcache import CachedWeightProvider, FullGPUProvider
from expertcache.decode_stack import DecodeStack, GraphedDecodeStep
from expertcache.kernels import _launch, moe_apply

pytestmark = pytest.mark.gpu


def test_store_is_pinned_exactly():
    weights = random_weights(24, 256, 96, dtype=torch.bfloat16, extras=True)
    before = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    provider = CachedWeightProvider(weights, cache_size=4, device="cuda")
    store = provider.store
    assert store.pinned and store.buffer.is_pinned()
    assert store.buffer[-1:].is_pinned() and store.buffer[:1].is_pinned()  # both ends registered
    assert store.nbytes == provider.pool.layout.buffer_bytes(24)
    assert store.nbytes < provider.pool.layout.expert_bytes * 24 + 256 * 5  # alignment padding only
    # pinned by cudaHostRegister on the exact buffer, not torch's power-of-two host allocator
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == before


def test_freeing_a_store_waits_for_copies_still_reading_it():
    """The store's pinned buffer is unregistered only once queued copies from it have run."""
    weights = random_weights(4, 2048, 2048, dtype=torch.bfloat16)  # 24 MiB per expert
    provider = CachedWeightProvider(weights, cache_size=4, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        provider.prepare(torch.tensor([[0, 1], [2, 3]], device="cuda"))  # copies queued
        torch.cuda._sleep(200_000_000)  # and more work behind them: ~0.1 s
        done = torch.cuda.Event()
        done.record()
    assert not done.query()  # still running
    slots = {name: t for name, t in provider.pool.tensors.items()}
    del provider
    gc.collect()
    assert done.query()  # freeing waited for the copies
    for name, tensor in slots.items():
        assert torch.equal(tensor[3].cpu(), weights[name][3])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_launches_run_on_the_cache_device():
    """Cache on cuda:1, current device cuda:0: kernels and copies land on cuda:1."""
    weights = random_weights(8, 64, 32, dtype=torch.bfloat16)
    for mode in ("host", "device"):
        provider = CachedWeightProvider(weights, cache_size=4, device="cuda:1", mode=mode)
        with torch.cuda.device(0):
            result = provider.prepare(torch.tensor([[0, 5]], device="cuda:1"))
            out = moe_apply(torch.randn(1, 64, device="cuda:1", dtype=torch.bfloat16), result.w1, result.w2,
                            torch.rand(1, 2, device="cuda:1"), result.topk_ids)  # fmt: skip
            assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(1)
        assert result.topk_ids.device == out.device == torch.device("cuda", 1)
        assert torch.equal(result.w1[provider.slot_of(5)].cpu(), weights["w1"][5])


def _slots_match_store(provider) -> None:
    for expert in provider.resident():
        slot = provider.slot_of(expert)
        for name, tensor in provider.pool.tensors.items():
            assert torch.equal(tensor[slot].cpu(), provider.store.tensors[name][expert])


@pytest.fixture(params=[True, False], ids=["chained", "unchained"])
def chained_launches(request, monkeypatch):
    """Run a test with the decode-path launches chained (programmatic dependent launch, on
    sm_90 and later) and without."""
    monkeypatch.setattr(_launch, "PROGRAMMATIC_LAUNCH", request.param)
    return request.param and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize("layers, experts, slots, top_k", [(4, 32, 10, 4), (3, 16, 4, 4)])
def test_graph_replays_equal_eager_and_full_weights(layers, experts, slots, top_k, chained_launches):
    """1,000 replays with changing routing, misses inside the graph, bf16, same kernels."""
    assert _launch.chains_launches(torch.device("cuda")) == chained_launches
    hidden_size, steps = 256, 1000
    gen = torch.Generator().manual_seed(layers)
    weights = [random_weights(experts, hidden_size, 128, dtype=torch.bfloat16, generator=gen) for _ in range(layers)]
    routing = torch.stack(
        [torch.stack([random_topk(1, top_k, experts, generator=gen) for _ in range(layers)]) for _ in range(steps + 1)]
    ).cuda()
    hidden = torch.randn(steps + 1, 1, hidden_size, generator=gen).to("cuda", torch.bfloat16)

    def stack(make):
        return DecodeStack([make(w) for w in weights], hidden_size, experts, dtype=torch.bfloat16, device="cuda")

    full = stack(lambda w: FullGPUProvider({k: v.cuda() for k, v in w.items()}))
    eager = stack(lambda w: CachedWeightProvider(w, cache_size=slots, device="cuda", mode="device"))
    host = stack(lambda w: CachedWeightProvider(w, cache_size=slots, device="cuda", mode="host"))
    graphed_stack = stack(lambda w: CachedWeightProvider(w, cache_size=slots, device="cuda", mode="device"))
    graphed = GraphedDecodeStep(graphed_stack, hidden[0], routing[:1])
    for other in (full, eager, host):
        other.step(hidden[0], routing[0])  # the warm-up step the graph ran
    for step in range(1, steps + 1):
        out = graphed(hidden[step], routing[step]).clone()
        assert torch.equal(out, full.step(hidden[step], routing[step])), step
        assert torch.equal(out, eager.step(hidden[step], routing[step])), step
        assert torch.equal(out, host.step(hidden[step], routing[step])), step
    misses = 0
    for graphed_layer, eager_layer, host_layer in zip(
        graphed_stack.providers, eager.providers, host.providers, strict=True
    ):
        assert graphed_layer.stats == eager_layer.stats == host_layer.stats
        misses += graphed_layer.stats.misses
        _slots_match_store(graphed_layer)
    assert misses > steps  # the graph really served misses


def test_chained_apply_waits_for_copies_of_large_experts(chained_launches):
    """Experts of Qwen3-30B-A3B's size (9.4 MB, ~0.2 ms over PCIe each) missed at every
    step of a graphed layer: an apply that did not wait for the copy would read the slots'
    old experts while the new ones are still arriving."""
    experts, hidden_size, inter, top_k, steps = 16, 2048, 768, 4, 24
    gen = torch.Generator().manual_seed(3)
    weights = random_weights(experts, hidden_size, inter, dtype=torch.bfloat16, generator=gen)
    routing = torch.stack([random_topk(1, top_k, experts, generator=gen)[None] for _ in range(steps + 1)]).cuda()
    hidden = torch.randn(steps + 1, 1, hidden_size, generator=gen).to("cuda", torch.bfloat16)
    full = DecodeStack([FullGPUProvider({k: v.cuda() for k, v in weights.items()})], hidden_size, experts,
                       dtype=torch.bfloat16, device="cuda")  # fmt: skip
    cached = CachedWeightProvider(weights, cache_size=top_k, device="cuda", mode="device")
    graphed = GraphedDecodeStep(
        DecodeStack([cached], hidden_size, experts, dtype=torch.bfloat16, device="cuda"), hidden[0], routing[:1]
    )
    for step in range(1, steps + 1):
        assert torch.equal(graphed(hidden[step], routing[step]), full.step(hidden[step], routing[step])), step
    assert cached.stats.misses >= steps  # copies in (nearly) every replay


def test_a_call_after_an_unfinished_overlapped_call_waits_for_its_copies():
    """An overlapped call whose misses pass is never asked for (its kernel raised, the
    generator is held): the next call on the pool still runs after its copies, so slots and
    tables agree with the store and the next result is right."""
    experts, hidden_size, inter, top_k = 16, 2048, 768, 4
    gen = torch.Generator().manual_seed(4)
    weights = random_weights(experts, hidden_size, inter, dtype=torch.bfloat16, generator=gen)
    provider = CachedWeightProvider(weights, cache_size=2 * top_k, device="cuda", mode="device")
    full = {k: v.cuda() for k, v in weights.items()}
    held = []
    for step in range(6):
        ids = torch.arange(top_k, device="cuda")[None] + (step * top_k) % experts  # all misses
        passes = provider.passes(ids, overlap=True)
        next(passes)  # the hits pass only; its copies still run on the copy stream
        held.append(passes)
        later = (ids + top_k) % experts
        result = provider.prepare(later)
        x, router = (
            torch.randn(1, hidden_size, device="cuda", dtype=torch.bfloat16),
            torch.rand(1, top_k, device="cuda"),
        )
        assert torch.equal(moe_apply(x, result.w1, result.w2, router, result.topk_ids),
                           moe_apply(x, full["w1"], full["w2"], router, later))  # fmt: skip
    torch.cuda.synchronize()
    _slots_match_store(provider)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graphed"])
def test_overlapped_passes_with_copies_in_flight_equal_the_resident_step(graph):
    """Decode calls that do not fit, served in overlapped passes (groups of half the share)
    with experts of Qwen3-30B-A3B's size: each pass's copies are still arriving while the
    pass before computes, so a copy landing in a slot being read would change the output.
    Eager and graphed steps equal the resident step bit for bit, every step."""
    layers, experts, hidden_size, inter, top_k, tokens, slots, steps = 2, 32, 2048, 768, 4, 16, 8, 6
    gen = torch.Generator().manual_seed(8)
    weights = [random_weights(experts, hidden_size, inter, dtype=torch.bfloat16, generator=gen) for _ in range(layers)]
    routing = torch.stack([
        torch.stack([random_topk(tokens, top_k, experts, generator=gen) for _ in range(layers)])
        for _ in range(steps + 1)
    ]).cuda()  # fmt: skip
    hidden = torch.randn(steps + 1, tokens, hidden_size, generator=gen).to("cuda", torch.bfloat16)
    full = DecodeStack([FullGPUProvider({k: v.cuda() for k, v in w.items()}) for w in weights], hidden_size, experts,
                       dtype=torch.bfloat16, device="cuda")  # fmt: skip
    cached = [CachedWeightProvider(w, cache_size=slots, device="cuda", mode="device") for w in weights]
    stack = DecodeStack(cached, hidden_size, experts, dtype=torch.bfloat16, device="cuda")
    assert stack.overlap  # moe_apply_passes sums passes exactly: the stack asks for overlapped passes
    run = GraphedDecodeStep(stack, hidden[0], routing[:1]) if graph else stack.step
    if graph:
        full.step(hidden[0], routing[0])
    for step in range(graph, steps + 1):
        assert torch.equal(run(hidden[step], routing[step]), full.step(hidden[step], routing[step])), step
    torch.cuda.synchronize()
    for provider in cached:
        assert provider.stats.overflows == 0 and provider.stats.misses > steps * slots  # many passes copied
        _slots_match_store(provider)
