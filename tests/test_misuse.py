"""Ordinary misuse found by an adversarial pass over the core: each fails loudly or works."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from conftest import devices
from helpers import random_weights, views

from expertcache import CachedWeightProvider, ConcurrentUseError, FullGPUProvider, SlotPool
from expertcache.kernels import moe_apply
from expertcache.policies import LRUPolicy


def test_parameters_are_copied_not_kept():
    """Module parameters as weights: the store holds no reference to them, results need no grad."""
    weights = {k: torch.nn.Parameter(v) for k, v in random_weights(6, 8, 4).items()}
    alive = weakref.ref(weights["w1"])
    provider = CachedWeightProvider(weights, cache_size=2, device="cpu")
    del weights
    gc.collect()
    assert alive() is None
    for ids in ([[0, 1]], [[2, 3]], [[4, 5]]):
        result = provider.prepare(torch.tensor(ids))
        assert not result.w1.requires_grad and result.w1.grad_fn is None


@pytest.mark.parametrize("device", devices())
def test_moe_apply_with_no_choice_gives_zeros(device):
    w = {k: v.to(device) for k, v in random_weights(4, 16, 8).items()}
    out = moe_apply(torch.randn(3, 16, device=device), w["w1"], w["w2"], torch.rand(3, 0, device=device),
                    torch.zeros(3, 0, dtype=torch.long, device=device))  # fmt: skip
    assert out.shape == (3, 16) and bool((out == 0).all())


def test_full_provider_hands_out_contiguous_ids():
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]]).t()  # a transposed view: not contiguous
    result = FullGPUProvider(random_weights(8, 16, 8)).prepare(ids)
    assert result.topk_ids.is_contiguous() and torch.equal(result.topk_ids, ids)


def test_a_refused_first_call_does_not_close_the_pool_to_layers():
    weights = random_weights(6, 8, 4)
    pool = SlotPool.for_weights(weights, 4, device="cpu")
    first = CachedWeightProvider(weights, pool=pool, layer="a")
    with pytest.raises(IndexError):
        first.prepare(torch.tensor([[99, 0]]))
    CachedWeightProvider(weights, pool=pool, layer="b")  # still open: nothing ran
    first.prepare(torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="before its first prepare"):
        CachedWeightProvider(weights, pool=pool, layer="c")


def test_a_refused_attach_leaves_the_pool_as_it_was():
    weights = random_weights(6, 8, 4)
    policy = LRUPolicy(capacity=4)
    CachedWeightProvider(weights, cache_size=4, policy=policy, device="cpu")
    pool = SlotPool.for_weights(weights, 4, device="cpu", policy=policy)  # the claim comes at attach
    with pytest.raises(ValueError, match="already drives another cache"):
        CachedWeightProvider(weights, pool=pool, layer="a")
    assert pool.layers == {} and pool.tables.num_keys == 0
    with pytest.raises(ValueError, match="built for capacity 3, not 4"):
        SlotPool.for_weights(weights, 4, device="cpu", policy=LRUPolicy(capacity=3))


def test_a_prepare_inside_a_prepare_is_named_as_such():
    weights = random_weights(6, 8, 4)
    pool = SlotPool.for_weights(weights, 4, device="cpu")
    layers = [CachedWeightProvider(weights, pool=pool, layer=name) for name in ("a", "b")]

    def reentrant_copy(pairs):
        layers[1].prepare(torch.tensor([[0]]))

    pool.copy_expert = reentrant_copy
    before = views(layers[0])
    with pytest.raises(ConcurrentUseError, match="from inside one of its own prepare"):
        layers[0].prepare(torch.tensor([[2, 3]]))
    assert views(layers[0]) == before


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"cache_size": 2, "pin_budget_bytes": "64GiB"}, TypeError, "pin_budget_bytes must be an int"),
        ({"cache_size": 2, "policy": ""}, ValueError, "unknown eviction policy ''"),
        ({"cache_size": 2, "mode": ""}, ValueError, "mode must be one of"),
    ],
)
def test_empty_or_mistyped_settings_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        CachedWeightProvider(random_weights(4, 8, 4), device="cpu", **kwargs)


def test_settings_that_cannot_apply_are_refused_and_numpy_sizes_are_fine():
    provider = CachedWeightProvider(random_weights(4, 8, 4), cache_size=np.int64(2), device="cpu")
    assert provider.pool.num_slots == 2
    with pytest.raises(ValueError, match="pin_budget_bytes applies when the store is built"):
        CachedWeightProvider(provider.store, cache_size=2, device="cpu", pin_budget_bytes=1)
