"""Bad input to a call over passes is refused before its first pass admits or copies anything.

Found by an adversarial pass: `moe_apply_passes` checked its inputs only as the first pass
came (after admission), `DecodeStack.step` found bad routing at the layer it broke (earlier
layers already changed), and `TimedProvider` served ``passes`` through ``prepare`` (so a call
its cache would split raised `CacheCapacityError`). Each case compares every public view
and every slot byte before and after, then checks the cache still serves the reference.
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import random_weights, same_bytes, slot_bytes, views

from expertcache import CachedWeightProvider, FullGPUProvider
from expertcache.decode_stack import DecodeStack
from expertcache.kernels import moe_apply_passes
from expertcache.reference import moe_forward
from expertcache.timed_provider import TimedProvider

EXPERTS, HIDDEN, INTER, SLOTS = 8, 16, 8, 4


def cache(mode: str, device: str, seed: int = 3) -> tuple[dict, CachedWeightProvider]:
    weights = random_weights(EXPERTS, HIDDEN, INTER, generator=torch.Generator().manual_seed(seed))
    provider = CachedWeightProvider(weights, cache_size=SLOTS, device=device, mode=mode)
    provider.prepare(torch.tensor([[0, 1], [2, 3]], device=device))  # something resident to lose
    return weights, provider


def snapshot(provider) -> tuple:
    return views(provider), slot_bytes(provider.pool)


def assert_unchanged(provider, before) -> None:
    now = snapshot(provider)
    assert now[0] == before[0] and same_bytes(now[1], before[1])


def assert_serves_reference(provider, weights, device) -> None:
    ids = torch.tensor([[6, 1], [7, 2]], device=device)
    hidden, router = torch.randn(2, HIDDEN, device=device), torch.rand(2, 2, device=device)
    result = provider.prepare(ids)
    full = {name: tensor.to(device) for name, tensor in weights.items()}
    assert torch.equal(
        moe_forward(hidden, result.w1, result.w2, router, result.topk_ids),
        moe_forward(hidden, full["w1"], full["w2"], router, ids),
    )


def modes() -> list:
    """(mode, device) pairs: both modes on each of `devices()`, keeping its gpu mark."""
    pairs = []
    for device in devices():
        value, marks = (device.values[0], device.marks) if hasattr(device, "values") else (device, ())
        pairs += [pytest.param(mode, value, marks=marks) for mode in ("host", "device")]
    return pairs


@pytest.mark.parametrize("mode, device", modes())
@pytest.mark.parametrize(
    "case",
    [
        "hidden of another width",  # known only against the weights: PassResults.preview
        "topk_weights of another K",  # known only against the call's ids
        "hidden of int dtype",
        "hidden 3-D",
    ],
)
def test_apply_over_passes_refuses_before_the_first_pass(mode, device, case):
    weights, provider = cache(mode, device)
    ids = torch.tensor([[4, 5], [6, 7], [0, 3]], device=device)  # 5 misses: a first pass would evict
    hidden, router = torch.randn(3, HIDDEN, device=device), torch.rand(3, 2, device=device)
    hidden, router = {
        "hidden of another width": (torch.randn(3, 2 * HIDDEN, device=device), router),
        "topk_weights of another K": (hidden, torch.rand(3, 3, device=device)),
        "hidden of int dtype": (hidden.long(), router),
        "hidden 3-D": (hidden[None], router),
    }[case]
    before = snapshot(provider)
    with pytest.raises((TypeError, ValueError)):
        moe_apply_passes(hidden, provider.passes(ids), router)
    assert_unchanged(provider, before)
    assert_serves_reference(provider, weights, device)


@pytest.mark.parametrize("device", devices())
def test_a_quantised_apply_refuses_landing_before_the_first_pass(device):
    from expertcache.kernels.quant_passes import moe_apply_quant_passes
    from expertcache.quant import QuantScheme

    weights, provider = cache("device", device)
    ids = torch.tensor([[4, 5], [6, 7]], device=device)
    before = snapshot(provider)
    with pytest.raises(ValueError, match="does not wait on landing counters"):
        moe_apply_quant_passes(torch.randn(2, HIDDEN, device=device), provider.passes(ids, overlap=True, landing=True),
                               torch.rand(2, 2, device=device), scheme=QuantScheme("none"))  # fmt: skip
    assert_unchanged(provider, before)


def stack_of(mode: str, device: str, layers: int = 3):
    pairs = [cache(mode, device, seed=layer) for layer in range(layers)]
    providers = [provider for _, provider in pairs]
    return pairs, DecodeStack(providers, HIDDEN, EXPERTS, dtype=torch.float32, device=device)


@pytest.mark.parametrize("mode, device", modes())
@pytest.mark.parametrize(
    "case",
    [
        "routing of L-1 layers",
        "routing of L+1 layers",  # once ignored silently
        "an id past E in the last layer",  # once found at the last layer, the others changed
        "a -1 in the last layer",
        "hidden of another width",
        "routing of float ids",
    ],
)
def test_a_decode_step_refuses_before_any_layer_runs(mode, device, case):
    pairs, stack = stack_of(mode, device)
    routing = torch.tensor([[[4, 5], [6, 7]]] * 3, device=device)
    hidden = torch.randn(2, HIDDEN, device=device)
    last_bad = routing.clone()
    last_bad[-1, 0, 0] = EXPERTS if case == "an id past E in the last layer" else -1
    hidden, routing = {
        "routing of L-1 layers": (hidden, routing[:2]),
        "routing of L+1 layers": (hidden, torch.cat([routing, routing[:1]])),
        "an id past E in the last layer": (hidden, last_bad),
        "a -1 in the last layer": (hidden, last_bad),
        "hidden of another width": (torch.randn(2, 2 * HIDDEN, device=device), routing),
        "routing of float ids": (hidden, routing.float()),
    }[case]
    befores = [snapshot(provider) for _, provider in pairs]
    with pytest.raises((TypeError, ValueError)):
        stack.step(hidden, routing)
    for (weights, provider), before in zip(pairs, befores, strict=True):
        assert_unchanged(provider, before)
        assert_serves_reference(provider, weights, device)


@pytest.mark.parametrize("device", devices())
def test_a_decode_step_checks_every_layers_prefetch_first(device):
    """Layer 2's cache holds fewer slots than the predictions: refused before layer 0 runs."""
    pairs = [cache("device", device, seed=layer) for layer in range(3)]
    weights = random_weights(EXPERTS, HIDDEN, INTER, generator=torch.Generator().manual_seed(9))
    pairs[2] = (weights, CachedWeightProvider(weights, cache_size=2, device=device, mode="device"))
    stack = DecodeStack([p for _, p in pairs], HIDDEN, EXPERTS, dtype=torch.float32, device=device)
    routing = torch.tensor([[[4, 5]]] * 3, device=device)
    prefetch = torch.tensor([[[1, 2, 3]]] * 3, device=device)  # 3 ids: more than layer 2's 2 slots
    befores = [(snapshot(p), p.prefetch_stats) for _, p in pairs]
    with pytest.raises(ValueError, match="prefetch at most num_slots=2"):
        stack.step(torch.randn(1, HIDDEN, device=device), routing, prefetch)
    for (_, provider), (before, prefetched) in zip(pairs, befores, strict=True):
        assert_unchanged(provider, before)
        assert provider.prefetch_stats == prefetched


@pytest.mark.parametrize("device", devices())
def test_a_stack_of_timed_caches_prefetches_and_checks_as_bare_ones(device):
    """Before, a `TimedProvider` hid its cache's mode and prefetch: a stack refused to
    prefetch into timed device-mode caches ("layer 1 is TimedProvider"), and skipped their
    router-width check."""
    pairs = [cache("device", device, seed=layer) for layer in range(2)]
    timed = [TimedProvider(provider) for _, provider in pairs]
    with pytest.raises(ValueError, match=r"num_experts=16 \(the router's width\) but layer 0's provider serves 8"):
        DecodeStack(timed, HIDDEN, 2 * EXPERTS, dtype=torch.float32, device=device)
    stack = DecodeStack(timed, HIDDEN, EXPERTS, dtype=torch.float32, device=device)
    routing = torch.tensor([[[4, 5]], [[6, 7]]], device=device)
    prefetch = torch.tensor([[[0, 1]], [[6, 7]]], device=device)  # row 1 goes to layer 1 after layer 0's router
    misses = pairs[1][1].stats.misses
    stack.step(torch.randn(1, HIDDEN, device=device), routing, prefetch)
    assert pairs[1][1].prefetch_stats.misses == 2 and timed[1].prefetch_stats == pairs[1][1].prefetch_stats
    assert pairs[1][1].stats.misses == misses and timed[0].mode == "device"  # layer 1's call found both
    assert not hasattr(TimedProvider(FullGPUProvider(pairs[0][0])), "prefetch")  # only what the cache has


@pytest.mark.parametrize("mode, device", modes())
def test_a_timed_provider_serves_passes_as_its_cache_does(mode, device):
    """A call of more experts than slots runs in passes through the wrapper too, with the
    same results as the bare cache's; the wrapper times each pass."""
    (weights, bare), (_, wrapped) = cache(mode, device), cache(mode, device)
    timed = TimedProvider(wrapped)
    ids = torch.tensor([[4, 5], [6, 7], [0, 3]], device=device)  # 6 experts, 4 slots
    hidden, router = torch.randn(3, HIDDEN, device=device), torch.rand(3, 2, device=device)
    for overlap in (False, True):
        expected = moe_apply_passes(hidden, bare.passes(ids, overlap=overlap), router)
        calls = timed.prepare_seconds()[0][-1][1]
        results = list(timed.passes(ids, overlap=overlap))
        assert len(results) == len(list(bare.passes(ids, overlap=overlap))) > 1
        assert timed.prepare_seconds()[0][-1][1] == calls + len(results)  # one observation a pass
        assert torch.equal(moe_apply_passes(hidden, timed.passes(ids, overlap=overlap), router), expected)
    assert timed.stats == wrapped.stats
    full = {name: tensor.to(device) for name, tensor in weights.items()}
    assert torch.allclose(expected, moe_forward(hidden, full["w1"], full["w2"], router, ids), atol=1e-5)


@pytest.mark.parametrize("device", devices())
def test_a_quantised_apply_names_hidden_when_its_width_is_wrong(device):
    """The message blames ``hidden``'s width, not ``w1``'s dtype; refused before the first pass."""
    from expertcache.kernels.quant_passes import moe_apply_quant_passes
    from expertcache.quant import QuantScheme

    weights, provider = cache("device", device)
    before = snapshot(provider)
    with pytest.raises(ValueError, match=f"hidden has {2 * HIDDEN} columns but the experts' H is {HIDDEN}"):
        moe_apply_quant_passes(torch.randn(2, 2 * HIDDEN, device=device),
                               provider.passes(torch.tensor([[4, 5], [6, 7]], device=device)),
                               torch.rand(2, 2, device=device), scheme=QuantScheme("none"))  # fmt: skip
    assert_unchanged(provider, before)
    assert_serves_reference(provider, weights, device)
