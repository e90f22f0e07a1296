"""Layer shares: a pool shared by several layers keeps every layer's ``num_slots // layers``.

The rule (`expertcache.layer_shares`) is what keeps one LRU over many layers from
thrashing; host mode (every policy), device mode and the simulator apply it alike (the
host-versus-device and policy-contract tests compare them call by call). Here: the rule
itself, that it stops the cyclic thrash, its errors, and that passes respect the share.
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import random_weights
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache import CacheCapacityError, CachedWeightProvider, SlotPool
from expertcache.layer_shares import layer_share
from expertcache.policies import POLICIES
from expertcache.sim.replay import replay
from expertcache.slot_table import SlotTable

RUNTIME_POLICIES = [name for name in POLICIES if name != "belady"]


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(RUNTIME_POLICIES),
    num_layers=st.integers(2, 4),
    share=st.integers(1, 4),
    extra=st.integers(0, 3),
    calls=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 7), min_size=1, max_size=8)), max_size=40),
)
def test_no_layer_is_pushed_below_its_share(policy, num_layers, share, extra, calls):
    """After any call of layer l, every other layer holds at least min(what it held, share)."""
    num_slots = num_layers * share + extra
    table = SlotTable(num_slots, policy=policy, num_layers=num_layers, layer_of=lambda key: key // 8)
    assert table.share == num_slots // num_layers
    for layer, experts in calls:
        layer %= num_layers
        keys = [8 * layer + expert for expert in dict.fromkeys(experts)][: table.share]
        held = [sum(key // 8 == index for key in table.resident()) for index in range(num_layers)]
        table.admit(keys)
        after = [sum(key // 8 == index for key in table.resident()) for index in range(num_layers)]
        for index in range(num_layers):
            if index != layer:
                assert after[index] >= min(held[index], table.share)
        assert len(table.resident()) <= num_slots


def _cyclic_calls(num_layers: int, steps: int, per_call: int, experts: int) -> list[list[int]]:
    """Every layer in turn, each call ``per_call`` experts of a rotating window (keys layer-major)."""
    calls = []
    for step in range(steps):
        for layer in range(num_layers):
            calls.append([layer * experts + (step + offset) % experts for offset in range(per_call)])
    return calls


def test_shares_stop_the_cyclic_thrash_of_one_lru():
    """12 layers whose calls need 4 experts each (3 of them the last call's), 36 slots: one
    LRU over all of them evicts what the next layer is about to use (no hit at all); with
    the shares each layer keeps its 3 slots and hits like a pool of its own."""
    calls = _cyclic_calls(12, 30, 4, 16)
    shared = replay(calls, policy="lru", capacity=36, num_layers=12, layer_of=lambda key: key // 16)
    plain = replay(calls, policy="lru", capacity=36)  # one layer's rule over all keys: the old behaviour
    per_layer = sum(
        (replay([call for call in calls if call[0] // 16 == layer], policy="lru", capacity=3) for layer in range(12)),
        start=replay([], policy="lru", capacity=3),
    )
    assert plain.hits == 0
    assert shared.hits == per_layer.hits > 0


def test_a_hot_layer_borrows_what_cold_layers_leave_idle_and_gives_it_back():
    """8 slots, share 4. Layer 0 calls 6 experts while layer 1 needs 1: layer 0 keeps 6.
    Then layer 1 needs 4: it takes the free slot, its own idle one and layer 0's two coldest,
    and layer 0 is left with exactly its share."""
    table = SlotTable(8, policy="lru", num_layers=2, layer_of=lambda key: key // 10)
    for _ in range(3):
        for group in ([0, 1, 2], [3, 4, 5]):
            table.admit(group)
        table.admit([10])
    assert {key for key in table.resident() if key < 10} == {0, 1, 2, 3, 4, 5}
    plan = table.admit([11, 12, 13, 14])
    assert [load.evicted for load in plan.loads] == [None, 0, 1, 10]
    assert table.resident() == {2, 3, 4, 5, 11, 12, 13, 14}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])
def test_a_shared_pool_refuses_a_call_above_the_share_and_changes_nothing(device, mode):
    weights = random_weights(8, 8, 4)
    pool = SlotPool.for_weights(weights, 7, device=device, mode=mode)
    layers = [CachedWeightProvider(weights, pool=pool, layer=index) for index in range(2)]
    layers[0].prepare(torch.tensor([[0, 1]], device=device))
    before = (layers[0].stats, layers[0].resident(), layers[1].resident())
    with pytest.raises(CacheCapacityError, match=r"shared by 2 layers.*its share, 3 \(num_slots // layers\)"):
        layers[1].prepare(torch.tensor([[0, 1, 2, 3]], device=device))
    assert (layers[0].stats, layers[0].resident(), layers[1].resident()) == before
    results = list(layers[1].passes(torch.tensor([[0, 1, 2, 3]], device=device)))  # in passes it works
    assert len(results) == 2 if mode == "host" else len(results) >= 2
    assert layers[1].stats.misses == 4 and layers[0].resident() == {0, 1}


def test_a_pool_serves_at_most_as_many_layers_as_it_has_slots():
    weights = random_weights(4, 8, 4)
    pool = SlotPool.for_weights(weights, 2, device="cpu")
    for index in range(2):
        CachedWeightProvider(weights, pool=pool, layer=index)
    with pytest.raises(ValueError, match="a pool of 2 slots can serve at most 2 layers"):
        CachedWeightProvider(weights, pool=pool, layer=2)
    assert len(pool.layers) == 2 and pool.share == 1
    with pytest.raises(ValueError, match="at most 3 layers"):
        layer_share(3, 4)


def test_a_shared_table_needs_the_layer_of_its_keys():
    with pytest.raises(ValueError, match="layer_of"):
        SlotTable(4, num_layers=2)
    table = SlotTable(4, num_layers=2, layer_of=lambda key: key // 10)
    for call in ([1, 11], [0, 1, 10], [0, 1, 2, 10]):  # within the share, above it, and in passes
        with pytest.raises(ValueError, match=r"keys of one layer, not of layers \[0, 1\]"):
            table.admit(call)
        with pytest.raises(ValueError, match="keys of one layer"):
            table.admit_passes(call)  # refused before any pass is admitted
    assert table.resident() == frozenset()
    table.admit([0, 1])
    for bad in ([20], [-5]):  # layer_of outside [0, 2)
        with pytest.raises(ValueError, match=r"layer_of gave -?\d+, not a layer in \[0, 2\)"):
            table.admit_passes(bad)
    assert table.resident() == {0, 1}
    table.admit([2])  # and the table keeps working
    assert table.resident() == {0, 1, 2}


def test_replay_of_shared_layers_checks_its_arguments_and_names_a_bad_call():
    layer_of = lambda key: key // 10  # noqa: E731
    with pytest.raises(ValueError, match="call 1: .*keys of one layer"):
        replay([[0], [0, 1, 10]], policy="lru", capacity=4, num_layers=2, layer_of=layer_of)
    with pytest.raises(TypeError, match="num_layers must be an int"):
        replay([[0]], policy="lru", capacity=4, num_layers="2", layer_of=layer_of)
    with pytest.raises(ValueError, match="needs layer_of"):
        replay([[0]], policy="lru", capacity=4, num_layers=2)
    with pytest.raises(TypeError, match="layer_of must be a function"):
        replay([[0]], policy="lru", capacity=4, num_layers=2, layer_of="x")
    with pytest.raises(ValueError, match="at most 4 layers"):
        replay([[0]], policy="lru", capacity=4, num_layers=5, layer_of=layer_of)
    for layers in (2, 3):  # calls without keys: nothing to admit, nothing refused
        assert replay([[], []], policy="lru", capacity=4, num_layers=layers, layer_of=layer_of).lookups == 0
