"""Bad input gets a clear error, and the cache is exactly as before and keeps working."""

from __future__ import annotations

import pytest
import torch
from helpers import random_weights, views

from expertcache import CacheCapacityError, CachedWeightProvider, FullGPUProvider, PinBudgetError, SlotPool
from expertcache.reference import moe_forward

E = 6


@pytest.fixture
def weights():
    return random_weights(E, 8, 4, generator=torch.Generator().manual_seed(0), extras=True)


snapshot = views


@pytest.mark.parametrize(
    "ids, error, message",
    [
        (torch.tensor([[0, 6]]), IndexError, "expert id 6"),  # one past the last expert
        (torch.tensor([[-1, 2]]), IndexError, "expert id -1"),  # negative
        (torch.tensor([[0.0, 1.0]]), TypeError, "int32 or int64"),  # float ids
        (torch.tensor([[0, 1]], dtype=torch.int16), TypeError, "int32 or int64"),
        (torch.tensor([0, 1]), ValueError, "2-D"),  # 1-D
        (torch.zeros(1, 2, 1, dtype=torch.long), ValueError, "2-D"),  # 3-D
        (torch.zeros(1, 2, dtype=torch.long, device="meta"), ValueError, "is on meta"),  # device
        ([[0, 1]], TypeError, "must be a tensor"),
        (torch.tensor([[0, 1, 2, 3]]), CacheCapacityError, "--moe-expert-cache-size 4"),
    ],
)
def test_bad_ids_change_nothing(weights, ids, error, message):
    provider = CachedWeightProvider(weights, cache_size=3, device="cpu")
    provider.prepare(torch.tensor([[0, 1], [2, 1]]))
    provider.prepare(torch.tensor([[4, 0]]))
    before = snapshot(provider)
    with pytest.raises(error, match=message):
        provider.prepare(ids)
    assert snapshot(provider) == before
    # still working, and still right
    ids = torch.tensor([[5, 1]])
    result = provider.prepare(ids)
    hidden, router = torch.randn(1, 8), torch.rand(1, 2)
    assert torch.equal(
        moe_forward(hidden, result.w1, result.w2, router, result.topk_ids),
        moe_forward(hidden, weights["w1"], weights["w2"], router, ids),
    )


def test_capacity_error_names_the_numbers(weights):
    provider = CachedWeightProvider(weights, cache_size=2, device="cpu")
    with pytest.raises(CacheCapacityError) as info:
        provider.prepare(torch.tensor([[0, 1], [2, 2], [3, 0]]))
    assert info.value.needed == 4 and info.value.num_slots == 2
    assert "needs 4 distinct experts" in str(info.value) and "only 2 slots" in str(info.value)
    assert isinstance(info.value, ValueError)


def drop(weights, name):
    return {k: v for k, v in weights.items() if k != name}


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda w: drop(w, "w1"), ValueError, "lacks \\['w1'\\]"),
        (lambda w: drop(w, "w2"), ValueError, "lacks \\['w2'\\]"),
        (lambda w: {**w, "bias": w["bias"][:-1]}, ValueError, "disagree on the number of experts"),
        (lambda w: {**w, "w2": w["w2"][:, :-1]}, ValueError, "disagree"),  # H mismatch
        (lambda w: {**w, "w1": w["w1"][:, :, :1, None]}, ValueError, "\\[E, 2I, H\\]"),  # 4-D w1
        (lambda w: {**w, "bias": torch.tensor(1.0)}, ValueError, "no expert dimension"),
        (lambda w: {**w, "bias": [1.0]}, TypeError, "str names to tensors"),
        (lambda w: list(w.values()), TypeError, "must map names"),
        (lambda w: {k: v[:0] for k, v in w.items()}, ValueError, "no experts"),
    ],
)
def test_bad_weights(weights, make, error, message):
    with pytest.raises(error, match=message):
        CachedWeightProvider(make(weights), cache_size=1, device="cpu")
    with pytest.raises(error, match=message):
        FullGPUProvider(make(weights))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"cache_size": 0}, ValueError, "between 1 and"),
        ({"cache_size": E + 1}, ValueError, "between 1 and"),
        ({"cache_size": 2.0}, TypeError, "must be an int"),
        ({}, ValueError, "cache_size .* is required"),
        ({"cache_size": 2, "device": "cuda:99"}, ValueError, "cuda"),
        ({"cache_size": 2, "device": "not-a-device"}, ValueError, "not a device"),
        ({"cache_size": 2, "device": "meta"}, ValueError, "unsupported device"),
        ({"cache_size": 2, "policy": "fifo"}, ValueError, "unknown eviction policy"),
        ({"cache_size": 2, "pin_budget_bytes": 100}, PinBudgetError, "nothing was pinned"),
        ({"cache_size": 2, "expert_map": torch.tensor([0, 1, 2], dtype=torch.int32)}, ValueError, "0..5"),
        ({"cache_size": 2, "expert_map": torch.tensor([0, 1, 2, 3, 4, 4, 5])}, ValueError, "exactly once"),
        ({"cache_size": 2, "expert_map": torch.tensor([0, 1, 2, 3, 4, 5, -2])}, ValueError, "or -1"),
        ({"cache_size": 2, "expert_map": torch.arange(6.0)}, TypeError, "int32 or int64"),
        ({"cache_size": 2, "expert_map": torch.arange(6).reshape(2, 3)}, ValueError, "1-D"),
    ],
)
def test_bad_configuration(weights, kwargs, error, message):
    with pytest.raises(error, match=message):
        CachedWeightProvider(weights, **{"device": "cpu", **kwargs})


def test_pin_budget_is_exact(weights):
    provider = CachedWeightProvider(weights, cache_size=2, device="cpu")
    needed = provider.store.nbytes
    assert needed == provider.pool.layout.buffer_bytes(E)
    CachedWeightProvider(weights, cache_size=2, device="cpu", pin_budget_bytes=needed)  # exactly enough
    with pytest.raises(PinBudgetError) as info:
        CachedWeightProvider(weights, cache_size=2, device="cpu", pin_budget_bytes=needed - 1)
    assert info.value.needed == needed


def test_shared_pool_rejects_mismatched_layers(weights):
    pool = SlotPool.for_weights(weights, 4, device="cpu")
    CachedWeightProvider(weights, pool=pool, layer="a")
    with pytest.raises(ValueError, match="already attached"):
        CachedWeightProvider(weights, pool=pool, layer="a")
    other = random_weights(E, 8, 2)  # another intermediate size
    with pytest.raises(ValueError, match="slot pool holds"):
        CachedWeightProvider(other, pool=pool, layer="b")
    for setting in ({"cache_size": 2}, {"policy": "lfu"}, {"mode": "host"}, {"device": "cpu"}):
        with pytest.raises(ValueError, match="belongs? to the shared pool"):
            CachedWeightProvider(weights, pool=pool, layer="c", **setting)
    with pytest.raises(TypeError, match="must be a SlotPool"):
        CachedWeightProvider(weights, pool=5, layer="c")


def test_views_reject_out_of_range(weights):
    provider = CachedWeightProvider(weights, cache_size=2, device="cpu")
    with pytest.raises(IndexError):
        provider.slot_of(E)
    with pytest.raises(IndexError):
        provider.expert_in(2)


def test_empty_call_is_a_no_op(weights):
    provider = CachedWeightProvider(weights, cache_size=2, device="cpu")
    result = provider.prepare(torch.zeros(0, 2, dtype=torch.long))
    assert result.topk_ids.shape == (0, 2)
    assert provider.resident() == frozenset() and provider.stats.calls == 1
