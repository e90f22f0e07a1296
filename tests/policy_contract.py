"""The contract every eviction policy meets, as a mixin its tests reuse (cachetools style).

A test class sets ``policy_name`` and inherits the checks: the table never evicts a key of
the current call, never holds more than ``capacity`` keys, counts distinct keys per call,
is deterministic, and the runtime provider and the simulator agree call by call.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_weights
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertcache import CachedWeightProvider, SlotPool
from expertcache.policies import POLICIES, make_policy
from expertcache.sim import replay
from expertcache.slot_table import SlotTable

#: Random call streams: (capacity, calls of keys from a small universe, forward starts).
streams = st.integers(1, 6).flatmap(
    lambda capacity: st.tuples(
        st.just(capacity),
        st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=capacity), min_size=1, max_size=40),
        st.sets(st.integers(0, 39)),
    )
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def _admit_all(policy_name: str, capacity: int, calls: list, starts: set) -> list:
    """Drive a `SlotTable` through ``calls``; Belady is told the future first."""
    table = SlotTable(capacity, policy=policy_name)
    if table.policy.clairvoyant:
        table.policy.set_future([tuple(dict.fromkeys(call)) for call in calls])
    admissions = []
    for index, call in enumerate(calls):
        if index in starts:
            table.begin_forward()
        before = table.resident()
        admission = table.admit(call)
        admissions.append((before, call, admission, table.resident()))
    return admissions


class PolicyContract:
    """Mixin: set ``policy_name``."""

    policy_name: str

    def test_registered_under_its_name(self):
        policy = make_policy(self.policy_name, capacity=4)
        assert policy.name == self.policy_name
        assert POLICIES[self.policy_name] is type(policy)
        assert make_policy(self.policy_name.upper(), capacity=4).name == self.policy_name

    @FAST
    @given(stream=streams)
    def test_table_invariants_hold_after_every_call(self, stream):
        capacity, calls, starts = stream
        for before, call, admission, after in _admit_all(self.policy_name, capacity, calls, starts):
            unique = list(dict.fromkeys(call))
            victims = [key for key, _ in admission.evictions]
            assert not set(victims) & set(unique), "evicted a key of the current call"
            assert len(after) <= capacity
            assert set(unique) <= after
            assert sorted(admission.hits + tuple(load.key for load in admission.loads)) == sorted(unique)
            assert set(admission.hits) == set(unique) & before
            assert after == (before - set(victims)) | set(unique)
            assert len(victims) == max(0, len(before) + len(admission.loads) - capacity)

    @FAST
    @given(stream=streams)
    def test_replay_counts_match_the_table_and_never_beat_belady(self, stream):
        capacity, calls, starts = stream
        admissions = _admit_all(self.policy_name, capacity, calls, starts)
        result = replay(calls, policy=self.policy_name, capacity=capacity, forward_starts=starts)
        assert result.hits == sum(len(a.hits) for _, _, a, _ in admissions)
        assert result.misses == sum(len(a.loads) for _, _, a, _ in admissions)
        assert result.evictions == sum(len(a.evictions) for _, _, a, _ in admissions)
        again = replay(calls, policy=self.policy_name, capacity=capacity, forward_starts=starts)
        assert result == again
        optimal = replay(calls, policy="belady", capacity=capacity)
        assert result.hits <= optimal.hits

    def test_a_cache_as_large_as_the_universe_only_misses_once_per_key(self):
        calls = [[k % 7, (3 * k) % 7] for k in range(50)]
        result = replay(calls, policy=self.policy_name, capacity=7)
        assert (result.misses, result.evictions) == (7, 0)

    def test_capacity_one(self):
        calls = [[0], [1], [1], [0], [2], [2]]
        result = replay(calls, policy=self.policy_name, capacity=1)
        assert (result.hits, result.misses, result.evictions) == (2, 4, 3)

    def test_choose_victim_changes_nothing_and_respects_protection(self):
        policy = make_policy(self.policy_name, capacity=3)
        if policy.clairvoyant:
            policy.set_future([(0, 1, 2), (3,)])
        policy.begin_call((0, 1, 2))
        for key in (0, 1, 2):
            policy.on_miss(key)
        policy.end_call()
        policy.begin_call((3,))
        first = policy.choose_victim(frozenset({3}), 3)
        assert first == policy.choose_victim(frozenset({3}), 3)
        assert policy.choose_victim(frozenset({3, first}), 3) != first
        with pytest.raises(LookupError):
            policy.choose_victim(frozenset({0, 1, 2, 3}), 3)

    def test_runtime_provider_agrees_with_the_simulator(self):
        """A shared pool of two layers (keys ``6 * layer + expert``) against replay, call by call."""
        if make_policy(self.policy_name, capacity=1).clairvoyant:  # simulation only: refused at once
            with pytest.raises(ValueError, match="simulation"):
                CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, device="cpu", policy=self.policy_name)
            return
        generator = torch.Generator().manual_seed(7)
        weights = random_weights(6, 8, 4, generator=generator)
        provider = CachedWeightProvider(weights, cache_size=4, device="cpu", policy=self.policy_name)
        pool = SlotPool.for_weights(weights, 5, device="cpu", policy=self.policy_name)
        layers = [CachedWeightProvider(weights, pool=pool, layer=index) for index in range(2)]
        private_calls, shared_calls = [], []
        for _ in range(30):
            ids = torch.randint(0, 6, (2, 2), generator=generator)
            provider.prepare(ids)
            private_calls.append(ids.reshape(-1).tolist())
            for index, layer in enumerate(layers):
                layer_ids = torch.randint(0, 6, (1, 2), generator=generator)
                layer.prepare(layer_ids)
                shared_calls.append([6 * index + e for e in layer_ids.reshape(-1).tolist()])
        expected = replay(private_calls, policy=self.policy_name, capacity=4)
        stats = provider.stats
        assert (stats.hits, stats.misses, stats.evictions) == (
            expected.hits,
            expected.misses,
            expected.evictions,
        )
        expected = replay(
            shared_calls, policy=self.policy_name, capacity=5, forward_starts=range(0, 60, 2), num_layers=2,
            layer_of=lambda key: key // 6,
        )  # fmt: skip
        total = layers[0].stats + layers[1].stats
        assert (total.hits, total.misses, total.evictions) == (
            expected.hits,
            expected.misses,
            expected.evictions,
        )
