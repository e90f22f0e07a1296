"""LRU semantics against an independent ``OrderedDict`` model, over random call sequences.

A hypothesis state machine drives one slot pool shared by 1-3 layers (one layer is the
per-layer budget; several are the global pool with keys (layer, expert)) through random
calls, bad calls, over-full calls and calls whose copy fails half-way (a failing copy, or
a KeyboardInterrupt, after the first tensor of the first miss). After every step the
provider's public views must agree with the model: hits, misses, victims and the slot of
every expert; the two tables are inverse; at most ``num_slots`` experts are resident; slot
buffers never move; a failed call leaves the slot bytes exactly as they were. With several
layers the model keeps every layer's share (``num_slots // layers``: a victim is never
another layer's key while that layer holds no more than its share).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from helpers import addresses, random_weights, same_bytes, slot_bytes
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from expertcache import CacheCapacityError, CachedWeightProvider, SlotPool

STEPS = {"count": 0}


class LRUModel:
    """The specification in a dozen lines: OrderedDict of key -> slot, least recent first."""

    def __init__(self, num_slots: int, num_layers: int) -> None:
        self.order: OrderedDict = OrderedDict()  # (layer, expert) -> slot
        self.free = list(range(num_slots))
        self.share = num_slots // num_layers

    def evictable(self, key, layer: int, unique: list) -> bool:
        held = sum(other[0] == key[0] for other in self.order)
        return key not in unique and (key[0] == layer or held > self.share)

    def call(self, keys: list) -> tuple[list, list, list]:
        unique = list(dict.fromkeys(keys))
        layer = unique[0][0]
        hits, misses, victims = [], [], []
        for key in unique:
            if key in self.order:
                self.order.move_to_end(key)
                hits.append(key)
                continue
            if self.free:
                slot = min(self.free)
                self.free.remove(slot)
            else:
                victim = next(k for k in self.order if self.evictable(k, layer, unique))
                slot = self.order.pop(victim)
                victims.append(victim)
            self.order[key] = slot
            misses.append(key)
        return hits, misses, victims


class SharedPoolLRU(RuleBasedStateMachine):
    @initialize(
        num_experts=st.integers(1, 10),
        num_layers=st.integers(1, 3),
        data=st.data(),
    )
    def build(self, num_experts, num_layers, data):
        self.num_experts = num_experts
        num_slots = data.draw(st.integers(num_layers, num_experts * num_layers), label="num_slots")
        self.model = LRUModel(num_slots, num_layers)
        self.weights = random_weights(num_experts, 8, 4, extras=True)
        self.pool = SlotPool.for_weights(self.weights, num_slots, device="cpu")
        self.layers = [CachedWeightProvider(self.weights, pool=self.pool, layer=index) for index in range(num_layers)]
        self.address = addresses(self.pool)

    def _snapshot(self):
        return [(p.stats, p.resident(), [p.slot_of(e) for e in range(self.num_experts)]) for p in self.layers]

    def _draw_call(self, data):
        layer = data.draw(st.integers(0, len(self.layers) - 1), label="layer")
        capacity = min(self.num_experts, self.pool.share)
        experts = data.draw(
            st.lists(st.integers(0, self.num_experts - 1), min_size=1, max_size=capacity, unique=True),
            label="experts",
        )
        tokens = data.draw(st.integers(1, 4), label="tokens")
        ids = data.draw(st.lists(st.sampled_from(experts), min_size=tokens, max_size=tokens * 3))
        ids = ids + experts  # every drawn expert appears; the order of first use is random
        return layer, data.draw(st.permutations(ids), label="ids")

    @rule(data=st.data())
    def call(self, data):
        STEPS["count"] += 1
        layer, ids = self._draw_call(data)
        provider = self.layers[layer]
        before = provider.stats
        resident_before = {(i, e) for i, p in enumerate(self.layers) for e in p.resident()}
        result = provider.prepare(torch.tensor(ids).reshape(1, -1))
        hits, misses, victims = self.model.call([(layer, e) for e in ids])
        after = provider.stats
        assert after.hits - before.hits == len(hits)
        assert after.misses - before.misses == len(misses)
        assert after.evictions - before.evictions == len(victims)
        resident_after = {(i, e) for i, p in enumerate(self.layers) for e in p.resident()}
        assert resident_before - resident_after == set(victims)
        assert resident_after - resident_before == set(misses)
        expected_slots = [self.model.order[(layer, e)] for e in ids]
        assert result.topk_ids.reshape(-1).tolist() == expected_slots

    @rule(data=st.data(), failure=st.sampled_from([RuntimeError, KeyboardInterrupt]))
    def failing_copy(self, data, failure):
        """The copy fails after its first tensor: rolled back, as if never called."""
        STEPS["count"] += 1
        layer, ids = self._draw_call(data)

        def copy_then_fail(pairs):
            destination, source = pairs[0]
            destination.copy_(source)
            raise failure("injected copy failure")

        provider = self.layers[layer]
        if all(provider.slot_of(e) >= 0 for e in ids):  # no miss: nothing to copy, it completes
            provider.prepare(torch.tensor(ids).reshape(1, -1))
            self.model.call([(layer, e) for e in ids])
            return
        before, held = self._snapshot(), slot_bytes(self.pool)
        original, self.pool.copy_expert = self.pool.copy_expert, copy_then_fail
        try:
            with pytest.raises(failure):
                provider.prepare(torch.tensor(ids).reshape(1, -1))
        finally:
            self.pool.copy_expert = original
        assert self._snapshot() == before
        assert same_bytes(slot_bytes(self.pool), held), "slot bytes changed"

    @rule(data=st.data())
    def overfull_call(self, data):
        """More distinct experts than a layer's share (all slots, for one layer): a clear
        error and no change."""
        STEPS["count"] += 1
        share = self.pool.share
        if self.num_experts <= share:
            return
        experts = data.draw(st.permutations(range(self.num_experts)))[: share + 1]
        before = self._snapshot()
        with pytest.raises(CacheCapacityError, match=f"needs {share + 1} distinct"):
            self.layers[0].prepare(torch.tensor([experts]))
        assert self._snapshot() == before

    @rule(bad=st.sampled_from(["float", "1-D", "negative", "too large"]))
    def bad_call(self, bad):
        STEPS["count"] += 1
        ids = {
            "float": torch.zeros(1, 2),
            "1-D": torch.zeros(3, dtype=torch.long),
            "negative": torch.tensor([[0, -1]]),
            "too large": torch.tensor([[self.num_experts]]),
        }[bad]
        before = self._snapshot()
        with pytest.raises((TypeError, ValueError, IndexError)):
            self.layers[0].prepare(ids)
        assert self._snapshot() == before

    @invariant()
    def tables_agree_with_the_model(self):
        resident = 0
        for index, provider in enumerate(self.layers):
            for expert in range(self.num_experts):
                slot = provider.slot_of(expert)
                assert slot == self.model.order.get((index, expert), -1)
                if slot >= 0:
                    assert provider.expert_in(slot) == expert
                    resident += 1
        for slot in range(self.pool.num_slots):
            owners = [(i, p.expert_in(slot)) for i, p in enumerate(self.layers) if p.expert_in(slot) >= 0]
            assert len(owners) <= 1
            for index, expert in owners:
                assert self.layers[index].slot_of(expert) == slot
        assert resident <= self.pool.num_slots
        assert addresses(self.pool) == self.address


def test_lru_matches_ordered_dict_model():
    STEPS["count"] = 0
    run_state_machine_as_test(
        SharedPoolLRU,
        settings=settings(
            max_examples=150,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert STEPS["count"] >= 2000, STEPS["count"]
