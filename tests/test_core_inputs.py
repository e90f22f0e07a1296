"""Bad input to the core (policies, slot pools, the simulator's table, the decode stack),
found by an adversarial pass: each is refused with a clear error and changes nothing, and
the cache keeps working after it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import devices
from helpers import random_weights, views

from expertcache import CachedWeightProvider, SlotPool
from expertcache.decode_stack import DecodeStack
from expertcache.policies import POLICIES, GDSFPolicy, LRUPolicy, SLRUPolicy
from expertcache.slot_table import SlotTable

HIDDEN, EXPERTS = 16, 8


class FixedVictim(LRUPolicy):
    """LRU, but ``choose_victim`` returns ``victim`` while it is set (a buggy user policy)."""

    name = "fixed_victim"

    def __init__(self, capacity, victim):
        super().__init__(capacity)
        self.victim = victim

    def choose_victim(self, protected, incoming):
        return self.victim if self.victim is not None else super().choose_victim(protected, incoming)


# -- a policy's victim that is no key of the pool ---------------------------------------------


@pytest.mark.parametrize(
    "victim",
    [
        -1,  # numpy read it as the last key's row: key 7 is resident, so its slot was taken (corrupt)
        EXPERTS,  # one past the last key
        10**9,
        "x",
        1.0,
        True,  # a bool indexes numpy as a mask
        np.bool_(True),
    ],
    ids=repr,
)
def test_a_victim_that_is_no_key_is_refused_and_changes_nothing(victim):
    policy = FixedVictim(2, None)
    provider = CachedWeightProvider(random_weights(EXPERTS, HIDDEN, 4), cache_size=2, device="cpu", policy=policy)
    provider.prepare(torch.tensor([[EXPERTS - 1, 0]]))  # the pool is full, the last key resident
    before = views(provider)
    policy.victim = victim
    with pytest.raises(RuntimeError, match="not an evictable key"):
        provider.prepare(torch.tensor([[2]]))
    assert views(provider) == before
    policy.victim = None  # the policy behaves again: the cache evicts as LRU
    provider.prepare(torch.tensor([[2]]))
    assert provider.resident() == {0, 2}
    assert (provider.stats.misses, provider.stats.evictions) == (3, 1)


def test_a_victim_that_is_no_key_of_a_shared_pool_is_refused_and_changes_nothing():
    weights = random_weights(EXPERTS, HIDDEN, 4)
    policy = FixedVictim(4, None)
    pool = SlotPool.for_weights(weights, 4, device="cpu", policy=policy)
    layers = [CachedWeightProvider(weights, pool=pool, layer=name) for name in ("a", "b")]
    layers[1].prepare(torch.tensor([[0, 1]]))  # layer b at its share: its keys are out of reach
    layers[0].prepare(torch.tensor([[0, 1]]))
    before = [views(layer) for layer in layers]
    policy.victim = "x"  # before: IndexError from numpy, reading the key's layer
    with pytest.raises(RuntimeError, match="not an evictable key"):
        layers[0].prepare(torch.tensor([[2]]))
    assert [views(layer) for layer in layers] == before
    policy.victim = None
    layers[0].prepare(torch.tensor([[2]]))
    assert layers[0].resident() == {1, 2} and layers[1].resident() == {0, 1}


# -- policy settings ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize(
    "capacity, error",
    [(True, TypeError), (2.0, TypeError), ("2", TypeError), (None, TypeError), (0, ValueError), (-1, ValueError)],
    ids=repr,
)
def test_a_policy_capacity_is_a_count_of_at_least_one(name, capacity, error):
    with pytest.raises(error, match="capacity must be"):
        POLICIES[name](capacity=capacity)


def test_a_policy_built_with_a_bool_capacity_is_not_taken_for_one_slot():
    """Before, ``LRUPolicy(True)`` matched a pool of one slot (True == 1) and served."""
    with pytest.raises(TypeError, match="capacity must be an int"):
        CachedWeightProvider(random_weights(4, HIDDEN, 4), cache_size=1, device="cpu", policy=LRUPolicy(True))
    provider = CachedWeightProvider(
        random_weights(4, HIDDEN, 4), cache_size=2, device="cpu", policy=LRUPolicy(np.int64(2))
    )  # numpy counts are counts
    provider.prepare(torch.tensor([[0, 1]]))
    provider.prepare(torch.tensor([[2]]))
    assert provider.resident() == {1, 2}


@pytest.mark.parametrize("fraction", [True, "0.5", None], ids=repr)
def test_an_slru_main_fraction_is_a_number(fraction):
    with pytest.raises(TypeError, match="main_fraction must be a number"):
        SLRUPolicy(4, main_fraction=fraction)
    assert SLRUPolicy(4, main_fraction=np.float64(0.5)).main_capacity == 2


def test_a_gdsf_cost_that_is_not_a_function_is_refused_before_any_call():
    """Before, it was taken and the first miss raised after the call was committed."""
    with pytest.raises(TypeError, match="cost must be a function of a key"):
        GDSFPolicy(2, cost=3)
    provider = CachedWeightProvider(
        random_weights(4, HIDDEN, 4), cache_size=2, device="cpu", policy=GDSFPolicy(2, cost=lambda key: 1 + key)
    )
    provider.prepare(torch.tensor([[0, 1]]))
    provider.prepare(torch.tensor([[2]]))
    assert provider.resident() == {1, 2}  # the cheaper key went


# -- a slot pool's views take only its own layers ----------------------------------------------


def test_a_pool_refuses_another_pools_layer_in_every_view():
    weights = random_weights(EXPERTS, HIDDEN, 4)
    mine = CachedWeightProvider(weights, cache_size=2, device="cpu")
    other = CachedWeightProvider(weights, cache_size=4, device="cpu")  # same name (0), same index
    other.prepare(torch.tensor([[1, 2, 3]]))
    before = views(mine)
    for read in (mine.pool.stats, mine.pool.expert_to_slot, mine.pool.prefetch_stats):
        with pytest.raises(ValueError, match="not attached to this slot pool"):
            read(other.layer)  # before: this pool's counters and table, silently
    with pytest.raises(ValueError, match="not attached to this slot pool"):
        mine.pool.expert_in(other.layer, 0)
    with pytest.raises(TypeError, match="layer must be a PoolLayer"):
        mine.pool.prepare(mine, torch.tensor([[0]]))  # the provider, not its layer
    with pytest.raises(TypeError, match="layer must be a PoolLayer"):
        mine.pool.stats("0")
    assert views(mine) == before
    assert mine.pool.stats(mine.layer) == mine.stats


@pytest.mark.parametrize("slot, error", [(-1, ValueError), (2, ValueError), (1.5, TypeError), (True, TypeError)])
def test_a_pool_reads_only_its_slots(slot, error):
    """Before, slot -1 read the last slot (and a float raised torch's indexing error)."""
    provider = CachedWeightProvider(random_weights(EXPERTS, HIDDEN, 4), cache_size=2, device="cpu")
    provider.prepare(torch.tensor([[5]]))
    with pytest.raises(error, match="slot must be"):
        provider.pool.expert_in(provider.layer, slot)
    assert provider.pool.expert_in(provider.layer, np.int64(0)) == 5


# -- the simulator's table ---------------------------------------------------------------------


def test_a_shared_table_takes_numpy_layers():
    """Before, ``layer_of`` giving ``np.int64(1)`` was refused as "not a layer in [0, 2)"."""
    table = SlotTable(4, num_layers=2, layer_of=lambda key: np.int64(key // 10))
    table.admit([10, 11])
    table.admit([0, 1])
    table.admit([2])  # layer 1 at its share: layer 0 evicts its own least recent key
    assert table.resident() == {10, 11, 1, 2}
    with pytest.raises(ValueError, match="not a layer in"):
        SlotTable(4, num_layers=2, layer_of=lambda key: np.int64(5)).admit([0])


# -- the decode stack --------------------------------------------------------------------------


def caches(num_experts=EXPERTS, layers=2, device="cpu"):
    return [CachedWeightProvider(random_weights(num_experts, HIDDEN, 4), cache_size=4, device=device)
            for _ in range(layers)]  # fmt: skip


@pytest.mark.parametrize(
    "settings, error, message",
    [
        ({"hidden_size": True}, TypeError, "hidden_size must be an int"),
        ({"hidden_size": float(HIDDEN)}, TypeError, "hidden_size must be an int"),
        ({"hidden_size": 0}, ValueError, "hidden_size must be >= 1"),
        ({"num_experts": 0}, ValueError, "num_experts must be >= 1"),
        ({"num_experts": "8"}, TypeError, "num_experts must be an int"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"seed": True}, TypeError, "seed must be an int"),
        ({"apply": "moe_apply_passes"}, TypeError, "apply must be an expert apply"),
        ({"apply": None}, TypeError, "apply must be an expert apply"),
    ],
    ids=repr,
)
def test_a_stack_refuses_bad_settings_when_built(settings, error, message):
    arguments = {"hidden_size": HIDDEN, "num_experts": EXPERTS, **settings}
    with pytest.raises(error, match=message):
        DecodeStack(caches(), dtype=torch.float32, device="cpu", **arguments)
    assert isinstance(DecodeStack(caches(), HIDDEN, EXPERTS, dtype=torch.float32, device="cpu", seed=np.int64(3)),
                      DecodeStack)  # fmt: skip


@pytest.mark.parametrize("device", devices())  # a step runs the Triton apply
def test_a_stack_wider_than_its_layers_is_refused_when_built(device):
    """Before, a step whose layer 1 routed to expert 9 of 8 ran layer 0 (admitting its
    experts), then raised."""
    layers = caches(device=device)
    with pytest.raises(ValueError, match=r"num_experts=16 \(the router's width\) but layer 0's provider serves 8"):
        DecodeStack(layers, HIDDEN, 16, dtype=torch.float32, device=device)
    stack = DecodeStack(layers, HIDDEN, EXPERTS, dtype=torch.float32, device=device)
    routing = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], device=device)
    out = stack.step(torch.randn(2, HIDDEN, device=device), routing)
    assert out.shape == (2, HIDDEN) and layers[1].resident() == {4, 5, 6, 7}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_a_step_refuses_hidden_of_another_dtype_and_changes_nothing(dtype, device):
    """Before: torch's matmul RuntimeError ("expected m1 and m2 to have the same dtype")."""
    layers = caches(device=device)
    stack = DecodeStack(layers, HIDDEN, EXPERTS, dtype=torch.float32, device=device)
    routing = torch.tensor([[[0, 1]], [[2, 3]]], device=device)
    before = [views(layer) for layer in layers]
    with pytest.raises(TypeError, match=f"hidden must be torch.float32 on {device}"):
        stack.step(torch.ones(1, HIDDEN, dtype=dtype, device=device), routing)
    assert [views(layer) for layer in layers] == before
    assert stack.step(torch.randn(1, HIDDEN, device=device), routing).dtype == torch.float32
