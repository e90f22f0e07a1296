"""Speculative prefetch (device mode): ``provider.prefetch(ids)`` admits and copies ahead.

* a prefetch decides like a call: the pool after ``prefetch(x); prepare(y)`` equals the
  pool after ``prepare(x); prepare(y)`` (slots, tables, slot bytes), and outputs equal the
  full-weights reference whatever was prefetched;
* its counts go to ``prefetch_stats``; ``stats`` counts only calls, whose hits now include
  the right guesses;
* misuse (host mode, a shared pool, more ids than slots, bad ids) raises and changes
  nothing; a prefetch whose copy fails leaves the pool as before;
* a stack hands each router's predictions ``lookahead`` layers on, each layer's before that
  layer's call, and its output does not depend on them;
* across steps, layer ``l``'s router hands layer ``(l + d) mod L`` its row, the last routers
  the next step's first layers, so a step after an oracle's finds every expert resident;
  a captured step joins those copies before it ends (``finish_prefetch``) and replays equal
  to the eager step without prefetches (GPU);
* a CUDA graph of a decode step that prefetches (one and two layers ahead) replays equal to
  the eager step without prefetches (GPU).
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import cached_and_full_stacks, random_topk, random_weights, same_bytes, slot_bytes, views

import expertcache.pool_prefetch as pool_prefetch
from expertcache import CachedWeightProvider, SlotPool
from expertcache.reference import moe_forward

E, HIDDEN, INTER = 12, 16, 8


def provider_on(device, weights, cache_size=4, **kwargs):
    return CachedWeightProvider(weights, cache_size=cache_size, mode="device", device=device, **kwargs)


def assert_serves_reference(provider, weights, ids, device, gen):
    hidden = torch.randn(ids.shape[0], HIDDEN, generator=gen).to(device)
    router = torch.rand(ids.shape, generator=gen).to(device)
    result = provider.prepare(ids)
    full = {name: tensor.to(device) for name, tensor in weights.items()}
    assert torch.equal(
        moe_forward(hidden, result.w1, result.w2, router, result.topk_ids),
        moe_forward(hidden, full["w1"], full["w2"], router, ids),
    )


@pytest.mark.parametrize("device", devices())
def test_a_prefetch_decides_like_a_call_and_counts_apart(device):
    gen = torch.Generator().manual_seed(1)
    weights = random_weights(E, HIDDEN, INTER, generator=gen)
    ahead, called = provider_on(device, weights), provider_on(device, weights)
    for _ in range(6):
        guess = random_topk(1, 3, E, generator=gen).to(device)
        ids = random_topk(2, 2, E, generator=gen).to(device)
        calls, prefetch_misses = ahead.stats, ahead.prefetch_stats.misses
        ahead.prefetch(guess.reshape(-1))
        called.prepare(guess)
        assert ahead.stats == calls  # a prefetch is not a call
        assert ahead.prefetch_stats.calls == called.stats.calls // 2 + 1
        resident_before = ahead.resident()
        assert_serves_reference(ahead, weights, ids, device, gen)
        called.prepare(ids)
        assert views(ahead)[1:] == views(called)[1:]  # same resident set, slots, owners
        assert same_bytes(slot_bytes(ahead.pool), slot_bytes(called.pool))
        hits = len(set(ids.reshape(-1).tolist()) & resident_before)
        assert ahead.stats.hits - calls.hits == hits  # the right guesses are hits
        assert ahead.prefetch_stats.misses >= prefetch_misses
    total = ahead.stats.misses + ahead.prefetch_stats.misses
    assert total == called.stats.misses  # every copy counted once, in one of the two


@pytest.mark.parametrize("device", devices())
def test_prefetch_misuse_raises_and_changes_nothing(device):
    gen = torch.Generator().manual_seed(2)
    weights = random_weights(E, HIDDEN, INTER, generator=gen)
    provider = provider_on(device, weights)
    provider.prepare(torch.tensor([[0, 1]], device=device))
    before = views(provider), slot_bytes(provider.pool), provider.prefetch_stats
    with pytest.raises(ValueError, match="at most num_slots=4"):
        provider.prefetch(torch.arange(5, device=device))
    with pytest.raises(TypeError, match="expert_ids must be int32 or int64"):
        provider.prefetch(torch.zeros(2, device=device))
    with pytest.raises(ValueError, match="2-D"):
        provider.prefetch(torch.zeros(1, 1, 2, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="must be a tensor"):
        provider.prefetch([1, 2])
    assert (views(provider), provider.prefetch_stats) == (before[0], before[2])
    assert same_bytes(slot_bytes(provider.pool), before[1])
    host = CachedWeightProvider(weights, cache_size=4, mode="host", device=device)
    with pytest.raises(ValueError, match="mode='device'"):
        host.prefetch(torch.tensor([1], device=device))
    pool = SlotPool.for_weights(weights, 4, device=device, mode="device")
    shared = [CachedWeightProvider(weights, pool=pool, layer=index) for index in range(2)]
    with pytest.raises(ValueError, match="a pool of one layer"):
        shared[0].prefetch(torch.tensor([1], device=device))
    assert shared[0].resident() == frozenset() and host.resident() == frozenset()


@pytest.mark.parametrize("device", devices())
def test_no_prefetch_between_an_overlapped_calls_hits_and_misses(device):
    """The misses pass's slots are promised when the hits pass is yielded: a prefetch then
    raises and changes nothing, and the call's output still equals the reference."""
    gen = torch.Generator().manual_seed(5)
    weights = random_weights(E, HIDDEN, INTER, generator=gen)
    provider = provider_on(device, weights)
    provider.prepare(torch.tensor([[0, 1], [2, 3]], device=device))
    ids = torch.tensor([[0, 5], [1, 6]], device=device)  # 2 hits, 2 misses
    hidden, router = torch.randn(2, HIDDEN, generator=gen).to(device), torch.rand(2, 2, generator=gen).to(device)
    full = {name: tensor.to(device) for name, tensor in weights.items()}
    passes = provider.passes(ids, overlap=True)
    hits = next(passes)
    part = moe_forward(hidden, hits.w1, hits.w2, router, hits.topk_ids)
    before = views(provider), provider.prefetch_stats
    with pytest.raises(RuntimeError, match="yet to yield a pass"):
        provider.prefetch(torch.tensor([8, 9, 10, 11], device=device))
    assert (views(provider), provider.prefetch_stats) == before
    misses = next(passes)
    part = part + moe_forward(hidden, misses.w1, misses.w2, router, misses.topk_ids)
    assert torch.allclose(part, moe_forward(hidden, full["w1"], full["w2"], router, ids), rtol=1e-5, atol=1e-6)
    assert next(passes, None) is None
    provider.prefetch(torch.tensor([8, 9], device=device))  # the call is over: allowed again
    assert {8, 9} <= provider.resident()


@pytest.mark.parametrize("device", devices())
def test_no_prefetch_while_overlapped_passes_are_owed(device):
    """Overlapped passes: once pass g is yielded, pass g + 1's copies are running into slots
    it was promised; a prefetch raises until the last pass is taken, changing nothing."""
    gen = torch.Generator().manual_seed(7)
    weights = random_weights(E, HIDDEN, INTER, generator=gen)
    provider = provider_on(device, weights)
    ids = torch.arange(E, device=device).reshape(-1, 2)  # every expert: more than the slots
    passes = provider.passes(ids, overlap=True)
    taken = [next(passes)]
    before = views(provider), provider.prefetch_stats
    with pytest.raises(RuntimeError, match="yet to yield a pass"):
        provider.prefetch(torch.tensor([0, 1], device=device))
    assert (views(provider), provider.prefetch_stats) == before
    taken += list(passes)
    assert len(taken) > 2
    provider.prefetch(torch.tensor([0, 1], device=device))  # the call is over: allowed again
    assert {0, 1} <= provider.resident()


def test_a_stack_refuses_predictions_it_cannot_prefetch_before_running_a_layer():
    from expertcache.decode_stack import DecodeStack

    gen = torch.Generator().manual_seed(6)
    weights = [random_weights(E, HIDDEN, INTER, generator=gen) for _ in range(2)]
    host = [CachedWeightProvider(w, cache_size=4, mode="host", device="cpu") for w in weights]
    stack = DecodeStack(host, HIDDEN, E, dtype=torch.float32, device="cpu")
    routing = torch.stack([random_topk(1, 2, E, generator=gen) for _ in range(2)])
    with pytest.raises(ValueError, match="layer 1 is CachedWeightProvider in host mode"):
        stack.step(torch.randn(1, HIDDEN), routing, routing)
    with pytest.raises(ValueError, match=r"prefetch must be \[L, T, P\]"):
        stack.step(torch.randn(1, HIDDEN), routing, routing[0])
    assert all(p.stats.calls == 0 for p in host)  # nothing ran


@pytest.mark.parametrize("device", devices())
def test_a_prefetch_whose_copy_fails_leaves_the_pool_as_before(monkeypatch, device):
    gen = torch.Generator().manual_seed(3)
    weights = random_weights(E, HIDDEN, INTER, generator=gen)
    provider = provider_on(device, weights)
    provider.prepare(torch.tensor([[0, 1], [2, 3]], device=device))  # full: the guesses evict
    before = views(provider), slot_bytes(provider.pool), provider.prefetch_stats
    real = pool_prefetch.copy_with_kernel  # a prefetch launches its copy there

    def copy_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("injected")

    monkeypatch.setattr(pool_prefetch, "copy_with_kernel", copy_then_fail)
    with pytest.raises(RuntimeError, match="injected"):
        provider.prefetch(torch.tensor([5, 6, 7], device=device))
    monkeypatch.undo()
    assert (views(provider), provider.prefetch_stats) == (before[0], before[2])
    assert same_bytes(slot_bytes(provider.pool), before[1])
    assert_serves_reference(provider, weights, torch.tensor([[5, 0], [6, 1]], device=device), device, gen)


def recorded_calls(monkeypatch, providers) -> list[tuple[str, int]]:
    """A list that fills with ``("prefetch" | "passes", layer)`` as the providers are called."""
    events: list[tuple[str, int]] = []
    for index, provider in enumerate(providers):
        for method in ("prefetch", "passes"):
            real = getattr(provider, method)
            recorder = lambda *a, real=real, name=(method, index), **k: (events.append(name), real(*a, **k))[1]  # noqa: E731
            monkeypatch.setattr(provider, method, recorder)
    return events


@pytest.mark.parametrize("lookahead", [1, 2, 4])
@pytest.mark.parametrize("device", devices())
def test_a_stack_prefetches_lookahead_layers_on_before_their_calls(monkeypatch, device, lookahead):
    gen = torch.Generator().manual_seed(7)
    cached, stacks, routing = cached_and_full_stacks(
        gen, tokens=1, cache_size=8, device=device, layers=4, lookahead=lookahead
    )
    events = recorded_calls(monkeypatch, cached)
    hidden = torch.randn(1, 64, generator=gen).to(device, torch.bfloat16)
    step_routing = routing()
    served = stacks[0].step(hidden, step_routing, step_routing)  # an oracle: every guess right
    after = min(lookahead, 3)  # the first router hands layers 1 .. lookahead their rows
    expected = [("prefetch", layer) for layer in range(1, after + 1)] + [("passes", 0)]
    for layer in range(1, 4):
        if layer + lookahead <= 3:
            expected.append(("prefetch", layer + lookahead))
        expected.append(("passes", layer))
    assert events == expected
    assert [p.prefetch_stats.calls for p in cached] == [0, 1, 1, 1]
    assert [p.stats.hits for p in cached[1:]] == [4, 4, 4]  # every call found its guesses resident
    assert torch.equal(served, stacks[1].step(hidden, step_routing))
    with pytest.raises(ValueError, match="lookahead"):
        type(stacks[0])(cached, 64, 16, dtype=torch.bfloat16, device=device, lookahead=0)


@pytest.mark.gpu
@pytest.mark.parametrize("lookahead", [1, 2])
def test_graphed_step_with_prefetch_replays_equal_to_eager_without(lookahead):
    from expertcache.decode_stack import GraphedDecodeStep

    gen = torch.Generator().manual_seed(4)
    cached, stacks, routing = cached_and_full_stacks(gen, tokens=2, cache_size=8, lookahead=lookahead)

    def guess(step_routing: torch.Tensor) -> torch.Tensor:  # half right, half wrong
        return torch.cat([step_routing[..., :2], (step_routing[..., 2:] + 5) % 16], dim=-1)

    hidden = torch.randn(2, 64, generator=gen).to("cuda", torch.bfloat16)
    warm = routing().unsqueeze(0)
    graph = GraphedDecodeStep(stacks[0], hidden, warm, guess(warm))
    with pytest.raises(ValueError, match="prefetch exactly when"):
        graph(hidden, routing())
    for _ in range(4):
        step_routing = routing()
        replayed = graph(hidden, step_routing, guess(step_routing)).clone()
        assert torch.equal(replayed, stacks[1].step(hidden, step_routing))
    assert all(p.prefetch_stats.calls == 5 for p in cached[1:])  # the warm-up step and 4 replays
    assert cached[0].prefetch_stats.calls == 0  # nothing runs before the first layer


def across_oracle(now: torch.Tensor, after: torch.Tensor, lookahead: int) -> torch.Tensor:
    """Predictions for a step across steps: rows ``0 .. d-1`` the next step's ids, the rest this one's."""
    return torch.cat([after[:lookahead], now[lookahead:]])


@pytest.mark.parametrize("lookahead", [1, 2, 3])
@pytest.mark.parametrize("device", devices())
def test_across_steps_the_last_routers_prefetch_the_next_steps_first_layers(monkeypatch, device, lookahead):
    gen = torch.Generator().manual_seed(8)
    cached, stacks, routing = cached_and_full_stacks(
        gen, tokens=1, cache_size=8, device=device, layers=4, lookahead=lookahead, across_steps=True
    )
    events = recorded_calls(monkeypatch, cached)
    steps = [routing() for _ in range(3)]
    hidden = torch.randn(1, 64, generator=gen).to(device, torch.bfloat16)
    for index in range(2):
        hits_before = [p.stats.hits for p in cached]
        served = stacks[0].step(hidden, steps[index], across_oracle(steps[index], steps[index + 1], lookahead))
        assert torch.equal(served, stacks[1].step(hidden, steps[index]))
    expected = []
    for layer in range(4):  # one hand-off a router, wrapping: no first-router burst
        expected += [("prefetch", (layer + lookahead) % 4), ("passes", layer)]
    assert events == expected * 2
    assert [p.prefetch_stats.calls for p in cached] == [2, 2, 2, 2]
    hits = [p.stats.hits - before for p, before in zip(cached, hits_before, strict=True)]
    assert hits == [4, 4, 4, 4]  # the second step: every layer's experts came ahead, its first ones last step


@pytest.mark.parametrize("device", devices())
def test_across_steps_refusals_run_nothing(device):
    from expertcache.decode_stack import DecodeStack

    gen = torch.Generator().manual_seed(9)
    weights = [random_weights(E, HIDDEN, INTER, generator=gen) for _ in range(3)]
    device_mode = [provider_on(device, w) for w in weights]
    for lookahead in (3, 4):
        with pytest.raises(ValueError, match="across_steps needs lookahead < the number of layers"):
            DecodeStack(
                device_mode, HIDDEN, E, dtype=torch.float32, device=device, lookahead=lookahead, across_steps=True
            )
    with pytest.raises(TypeError, match="across_steps"):
        DecodeStack(device_mode, HIDDEN, E, dtype=torch.float32, device=device, across_steps="yes")
    first_host = [CachedWeightProvider(weights[0], cache_size=4, mode="host", device=device), *device_mode[1:]]
    stack = DecodeStack(first_host, HIDDEN, E, dtype=torch.float32, device=device, across_steps=True)
    routing = torch.stack([random_topk(1, 2, E, generator=gen) for _ in range(3)]).to(device)
    with pytest.raises(ValueError, match=r"layers 0\.\.2; layer 0 is CachedWeightProvider in host mode"):
        stack.step(torch.randn(1, HIDDEN, device=device), routing, routing)
    assert all(p.stats.calls == 0 and p.prefetch_stats.calls == 0 for p in device_mode)  # nothing ran
    without = DecodeStack(first_host, HIDDEN, E, dtype=torch.float32, device=device, lookahead=2)
    without.step(torch.randn(1, HIDDEN, device=device), routing, routing)  # not across steps: layer 0 gets no row
    first_host[0].finish_prefetch()  # host mode: nothing to join
    with pytest.raises(ValueError, match="not attached|attached"):
        device_mode[1].pool.finish_prefetch(device_mode[2].layer)


@pytest.mark.gpu
@pytest.mark.parametrize("lookahead", [1, 2])
def test_graphed_step_across_steps_joins_its_prefetches_and_replays_equal_to_eager(lookahead):
    from expertcache.decode_stack import GraphedDecodeStep

    gen = torch.Generator().manual_seed(5)
    cached, stacks, routing = cached_and_full_stacks(
        gen, tokens=2, cache_size=8, layers=4, lookahead=lookahead, across_steps=True
    )
    steps = [routing() for _ in range(7)]
    hidden = torch.randn(2, 64, generator=gen).to("cuda", torch.bfloat16)
    warm = steps[0].unsqueeze(0)
    graph = GraphedDecodeStep(stacks[0], hidden, warm, across_oracle(steps[0], steps[1], lookahead).unsqueeze(0))
    before = [p.stats for p in cached]
    for index in range(1, 6):  # capture ran one step (it prefetched step 1's first layers)
        replayed = graph(hidden, steps[index], across_oracle(steps[index], steps[index + 1], lookahead)).clone()
        assert torch.equal(replayed, stacks[1].step(hidden, steps[index]))
    after = [p.stats for p in cached]
    distinct = [sum(len(set(steps[i][layer].flatten().tolist())) for i in range(1, 6)) for layer in range(4)]
    assert [a.hits - b.hits for a, b in zip(after, before, strict=True)] == distinct  # every expert came ahead
    assert [a.misses - b.misses for a, b in zip(after, before, strict=True)] == [0] * 4
