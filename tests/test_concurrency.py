"""One caller at a time, one cache per policy object: misuse fails loudly instead of corrupting."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import devices
from helpers import random_weights

import expertcache.device_prepare as device_prepare
from expertcache import CachedWeightProvider, ConcurrentUseError, SlotPool
from expertcache.policies import LRUPolicy
from expertcache.sim import replay


def _hold_first_call(monkeypatch, provider, mode):
    """Make the next call stop in the middle until ``release`` is set; returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()

    def paused(real):
        def wrapper(*args, **kwargs):
            entered.set()
            assert release.wait(10)
            return real(*args, **kwargs)

        return wrapper

    if mode == "host":
        provider.pool.copy_expert = paused(provider.pool.copy_expert)
    else:
        monkeypatch.setattr(device_prepare, "admit", paused(device_prepare.admit))
    return entered, release


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])
def test_a_second_thread_gets_a_clear_error(monkeypatch, device, mode):
    weights = random_weights(6, 8, 4)
    pool = SlotPool.for_weights(weights, 4, device=device, mode=mode)
    layers = [CachedWeightProvider(weights, pool=pool, layer=name) for name in ("a", "b")]
    entered, release = _hold_first_call(monkeypatch, layers[0], mode)
    results = {}
    first = threading.Thread(target=lambda: results.update(a=layers[0].prepare(torch.tensor([[0, 1]], device=device))))
    first.start()
    assert entered.wait(10)
    with pytest.raises(ConcurrentUseError, match="another thread"):
        layers[1].prepare(torch.tensor([[2, 3]], device=device))  # same pool, other layer
    release.set()
    first.join(10)
    assert results["a"].topk_ids.tolist() == [[0, 1]]
    assert layers[0].resident() == {0, 1} and layers[1].resident() == frozenset()
    assert layers[1].stats.calls == 0
    monkeypatch.undo()
    layers[1].prepare(torch.tensor([[2, 3]], device=device))  # the pool works on
    assert layers[1].resident() == {2, 3}


def test_a_policy_object_serves_one_cache():
    weights = random_weights(6, 8, 4)
    policy = LRUPolicy(capacity=3)
    CachedWeightProvider(weights, cache_size=3, policy=policy, device="cpu")
    with pytest.raises(ValueError, match="already drives another cache"):
        CachedWeightProvider(weights, cache_size=3, policy=policy, device="cpu")
    with pytest.raises(ValueError, match="already drives another cache"):
        replay([[0, 1]], policy=policy, capacity=3)
    with pytest.raises(ValueError, match="built for capacity 3, not 4"):
        CachedWeightProvider(weights, cache_size=4, policy=LRUPolicy(capacity=3), device="cpu")
    fresh = LRUPolicy(capacity=2)
    replay([[0, 1]], policy=fresh, capacity=2)
    with pytest.raises(ValueError, match="already drives another cache"):
        replay([[0, 1]], policy=fresh, capacity=2)


def test_a_refused_pool_leaves_its_policy_free():
    """A policy object handed to a cache that fails to build is not bound to it."""
    policy = LRUPolicy(capacity=3)
    with pytest.raises(ValueError, match="cache_size"):
        CachedWeightProvider(random_weights(2, 8, 4), cache_size=3, policy=policy, device="cpu")
    CachedWeightProvider(random_weights(6, 8, 4), cache_size=3, policy=policy, device="cpu")


@pytest.mark.parametrize("device", devices())
def test_device_mode_refuses_a_policy_object(device):
    with pytest.raises(TypeError, match="own LRU"):
        SlotPool.for_weights(random_weights(4, 8, 4), 2, mode="device", policy=LRUPolicy(capacity=2), device=device)
    pool = SlotPool.for_weights(random_weights(4, 8, 4), 2, mode="device", policy="LRU", device=device)
    assert pool.mode == "device"
