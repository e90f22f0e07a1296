"""Argument types at the public constructors and calls: every integer type is a count (never a
bool or a float), a budget is never negative, ids are dense tensors, and a pool is built from a
layout. Each refusal is a TypeError or ValueError that names the argument and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import devices
from helpers import random_weights, views

from expertcache import CachedWeightProvider, FullGPUProvider, PinBudgetError, SlotPool
from expertcache.config import ExpertCacheConfig
from expertcache.layout import layout_from_weights
from expertcache.store import CPUBackingStore

NUM_EXPERTS = 6


@pytest.fixture
def weights():
    return random_weights(NUM_EXPERTS, 8, 4, generator=torch.Generator().manual_seed(0))


def store_bytes(weights) -> int:
    """What the pinned store of ``weights`` needs: a store without a budget says."""
    return CPUBackingStore(layout_from_weights(weights)[1], weights, pin=False).nbytes


def served(weights, cache_size=2) -> CachedWeightProvider:
    """A provider that has served two calls, so its tables hold state a refusal could spoil."""
    provider = CachedWeightProvider(weights, cache_size=cache_size, device="cpu")
    provider.prepare(torch.tensor([[0, 1]]))
    provider.prepare(torch.tensor([[1, 2]]))
    return provider


# -- pin budgets: an int >= 0 or None -----------------------------------------------------------


@pytest.mark.parametrize("budget", [-1, np.int64(-1), -(2**40)])
def test_a_negative_pin_budget_is_a_bad_value_not_an_exceeded_budget(weights, budget):
    for build in (
        lambda: CachedWeightProvider(weights, cache_size=2, device="cpu", pin_budget_bytes=budget),
        lambda: CPUBackingStore(layout_from_weights(weights)[1], weights, pin=False, pin_budget_bytes=budget),
    ):
        with pytest.raises(ValueError, match=r"pin_budget_bytes must be >= 0") as caught:
            build()
        assert not isinstance(caught.value, PinBudgetError)
        assert "exceed" not in str(caught.value) and "needs" not in str(caught.value)


def test_a_zero_pin_budget_is_a_budget_every_store_exceeds(weights):
    with pytest.raises(PinBudgetError, match="pin_budget_bytes is 0"):
        CachedWeightProvider(weights, cache_size=2, device="cpu", pin_budget_bytes=0)


@pytest.mark.parametrize("integer", [int, np.int64, np.int32, np.uint64])
def test_numpy_pin_budgets_are_bytes(weights, integer):
    needed = store_bytes(weights)
    provider = CachedWeightProvider(weights, cache_size=2, device="cpu", pin_budget_bytes=integer(needed))
    assert provider.store.nbytes == needed
    with pytest.raises(PinBudgetError, match=f"pin_budget_bytes is {needed - 1} "):
        CachedWeightProvider(weights, cache_size=2, device="cpu", pin_budget_bytes=integer(needed - 1))
    store = CPUBackingStore(provider.pool.layout, weights, pin=False, pin_budget_bytes=integer(needed))
    assert torch.equal(store.tensors["w1"], weights["w1"])


@pytest.mark.parametrize("budget", [True, False, np.True_, 1.5e9, 4096.0, np.float64(4096), "64GiB", [4096]])
def test_pin_budgets_that_are_not_integers_are_type_errors(weights, budget):
    layout = layout_from_weights(weights)[1]
    for build in (
        lambda: CachedWeightProvider(weights, cache_size=2, device="cpu", pin_budget_bytes=budget),
        lambda: CPUBackingStore(layout, weights, pin=False, pin_budget_bytes=budget),
    ):
        with pytest.raises(TypeError, match="pin_budget_bytes must be an int"):
            build()


def test_a_refused_pin_budget_leaves_a_shared_pool_as_it_was(weights):
    pool = SlotPool.for_weights(weights, 4, device="cpu")
    first = CachedWeightProvider(weights, pool=pool, layer="a")
    first.prepare(torch.tensor([[0, 1]]))
    before, layers = views(first), dict(pool.layers)
    for budget in (-1, 2.0, True):
        with pytest.raises((TypeError, ValueError), match="pin_budget_bytes must be"):
            CachedWeightProvider(weights, pool=pool, layer="b", pin_budget_bytes=budget)
    assert pool.layers == layers and views(first) == before
    first.prepare(torch.tensor([[2, 3]]))  # still serving
    assert first.resident() == {0, 1, 2, 3}


# -- slot counts: any integer >= 1 --------------------------------------------------------------


@pytest.mark.parametrize("integer", [int, np.int64, np.int32, np.int8, np.uint16])
def test_numpy_slot_counts_build_a_pool_that_serves(weights, integer):
    pool = SlotPool.for_weights(weights, integer(4), device="cpu")
    assert type(pool.num_slots) is int and pool.num_slots == 4
    assert all(tensor.shape[0] == 4 for tensor in pool.tensors.values())
    provider = CachedWeightProvider(weights, pool=pool)
    result = provider.prepare(torch.tensor([[0, 5]]))
    assert torch.equal(result.w1[result.topk_ids[0, 1]], weights["w1"][5])


@pytest.mark.parametrize("integer", [np.int64, np.int32, np.uint8])
def test_numpy_cache_sizes_build_a_cache_that_serves(weights, integer):
    provider = CachedWeightProvider(weights, cache_size=integer(3), device="cpu")
    assert type(provider.pool.num_slots) is int and provider.pool.num_slots == 3
    provider.prepare(torch.tensor([[0, 1, 2]]))
    assert provider.resident() == {0, 1, 2}


@pytest.mark.parametrize("count", [True, np.True_, 4.0, np.float64(4), "4", None, torch.tensor(4.0)])
def test_slot_counts_that_are_not_integers_are_type_errors(weights, count):
    with pytest.raises(TypeError, match="num_slots must be an int"):
        SlotPool.for_weights(weights, count, device="cpu")
    if count is not None:  # None: cache_size omitted, a ValueError of its own
        with pytest.raises(TypeError, match="cache_size must be an int"):
            CachedWeightProvider(weights, cache_size=count, device="cpu")


@pytest.mark.parametrize("count", [0, -1, np.int64(0)])
def test_slot_counts_below_one_are_value_errors(weights, count):
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        SlotPool.for_weights(weights, count, device="cpu")
    with pytest.raises(ValueError, match="cache_size must be between 1 and"):
        CachedWeightProvider(weights, cache_size=count, device="cpu")


@pytest.mark.parametrize("count", [2**31, np.int64(2**62), 10**30])
def test_slot_counts_past_int32_slot_ids_are_value_errors(weights, count):
    with pytest.raises(ValueError, match="num_slots must be <= 2,147,483,647"):
        SlotPool.for_weights(weights, count, device="cpu")


def test_a_numpy_cache_size_above_the_experts_is_a_value_error(weights):
    with pytest.raises(ValueError, match=f"number of local experts \\({NUM_EXPERTS}\\), got 7"):
        CachedWeightProvider(weights, cache_size=np.int64(7), device="cpu")


# -- ids: dense tensors only ---------------------------------------------------------------------

SPARSE = [
    pytest.param(lambda ids: ids.to_sparse(), "sparse_coo", id="coo"),
    pytest.param(lambda ids: ids.to_sparse_csr(), "sparse_csr", id="csr"),
    pytest.param(lambda ids: torch.nested.as_nested_tensor(list(ids), layout=torch.jagged), "nested", id="nested"),
]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("make, kind", SPARSE)
def test_sparse_or_nested_ids_are_refused_by_name_and_change_nothing(weights, make, kind):
    provider = served(weights)
    before = views(provider)
    ids = make(torch.tensor([[0, 3], [4, 5]]))
    message = f"topk_ids must be a dense \\(strided\\) tensor, got a {kind} tensor"
    with pytest.raises(TypeError, match=message):
        provider.prepare(ids)
    with pytest.raises(TypeError, match=message):
        provider.passes(ids)
    with pytest.raises(TypeError, match=message):
        FullGPUProvider(weights).prepare(ids)
    assert views(provider) == before
    provider.prepare(torch.tensor([[0, 3]]))  # still serving
    assert provider.resident() == {0, 3}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("device", devices())  # prefetch is device mode's: the interpreter or a GPU
@pytest.mark.parametrize("make, kind", SPARSE[:1])  # 1-D ids: COO is the layout that has them
def test_sparse_prefetch_ids_are_refused_by_name(weights, make, kind, device):
    provider = CachedWeightProvider(weights, cache_size=2, device=device, mode="device")
    before, prefetched = views(provider), provider.prefetch_stats
    with pytest.raises(TypeError, match=f"expert_ids must be a dense \\(strided\\) tensor, got a {kind} tensor"):
        provider.prefetch(make(torch.tensor([0, 3], device=device)))
    with pytest.raises(TypeError, match="expert_ids must be a dense"):
        provider.check_prefetch(make(torch.tensor([[0, 3]], device=device)))
    assert views(provider) == before and provider.prefetch_stats == prefetched


def test_a_sparse_expert_map_is_refused_by_name(weights):
    expert_map = torch.tensor([-1, 0, 1, 2, 3, 4, 5, -1], dtype=torch.int32)
    with pytest.raises(TypeError, match="expert_map must be a dense"):
        CachedWeightProvider(weights, cache_size=2, device="cpu", expert_map=expert_map.to_sparse())
    with pytest.raises(TypeError, match="expert_map must be a dense"):
        FullGPUProvider(weights, expert_map=expert_map.to_sparse())
    CachedWeightProvider(weights, cache_size=2, device="cpu", expert_map=expert_map)  # dense: fine


# -- what a pool is built from -------------------------------------------------------------------


@pytest.mark.parametrize("layout", [dict, "weights", None], ids=["dict-class", "str", "none"])
def test_a_pool_of_something_other_than_a_layout_is_a_type_error(layout):
    with pytest.raises(TypeError, match="layout must be an ExpertLayout, got .*SlotPool.for_weights"):
        SlotPool(layout, 4, device="cpu")


def test_a_pool_of_a_weights_dict_points_to_for_weights(weights):
    with pytest.raises(TypeError, match=r"got dict; .*dict of weights use SlotPool.for_weights\(weights, num_slots\)"):
        SlotPool(weights, 4, device="cpu")
    with pytest.raises(TypeError, match="got the class dict"):
        SlotPool(dict, 4, device="cpu")


def test_attaching_a_weights_dict_instead_of_a_store_changes_nothing(weights):
    pool = SlotPool.for_weights(weights, 4, device="cpu")
    first = CachedWeightProvider(weights, pool=pool, layer="a")
    before = views(first)
    with pytest.raises(TypeError, match="store must be a CPUBackingStore, got dict"):
        pool.attach("b", weights, torch.arange(NUM_EXPERTS, dtype=torch.int32))
    with pytest.raises(TypeError, match="global_to_local must be a tensor, got list"):
        pool.attach("b", first.store, list(range(NUM_EXPERTS)))
    assert list(pool.layers) == ["a"] and pool.tables.num_keys == NUM_EXPERTS and views(first) == before
    CachedWeightProvider(weights, pool=pool, layer="b")  # the pool still takes layers
    assert pool.tables.num_keys == 2 * NUM_EXPERTS


def test_a_store_of_something_other_than_a_layout_and_weights_is_a_type_error(weights):
    layout = layout_from_weights(weights)[1]
    with pytest.raises(TypeError, match="layout must be an ExpertLayout"):
        CPUBackingStore(weights, weights, pin=False)
    with pytest.raises(TypeError, match="weights must map names to"):
        CPUBackingStore(layout, list(weights.values()), pin=False)


def test_a_config_takes_numpy_counts_as_ints_and_refuses_a_negative_budget():
    config = ExpertCacheConfig(cache_size=np.int64(4), pin_budget_bytes=np.int32(1 << 20))
    assert (config.cache_size, config.pin_budget_bytes) == (4, 1 << 20)
    assert type(config.cache_size) is int and type(config.pin_budget_bytes) is int
    with pytest.raises(ValueError, match=r"pin_budget_bytes must be >= 0"):
        ExpertCacheConfig(cache_size=4, pin_budget_bytes=np.int64(-1))
    with pytest.raises(TypeError, match="cache_size must be an int"):
        ExpertCacheConfig(cache_size=np.float64(4.0))


def test_the_integrations_pin_budget_check_calls_a_negative_budget_a_bad_value():
    from expertcache.integrations.transformers.serving import check_pin_budget

    with pytest.raises(ValueError, match=r"pin_budget_bytes must be >= 0") as caught:
        check_pin_budget([], [], -1)
    assert not isinstance(caught.value, PinBudgetError)  # it said the budget was exceeded
    check_pin_budget([], [], np.int64(0))  # nothing to pin fits any budget
