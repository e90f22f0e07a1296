"""Every eviction policy: the shared contract, plus the behaviour that makes each one itself."""

from __future__ import annotations

import random

import pytest
from policy_contract import PolicyContract

from expertcache.policies import POLICIES, GDSFPolicy, SLRUPolicy, make_policy
from expertcache.sim import replay

# The textbook page-reference string (Silberschatz et al., "Operating System Concepts"):
# with 3 frames, optimal replacement faults 9 times, LRU 12 times.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def _single(keys):
    return [[key] for key in keys]


class TestLRU(PolicyContract):
    policy_name = "lru"

    def test_textbook_fault_count(self):
        assert replay(_single(TEXTBOOK), policy="lru", capacity=3).misses == 12


class TestLFU(PolicyContract):
    policy_name = "lfu"

    def test_keeps_the_frequent_key_through_a_scan(self):
        calls = _single([0, 0, 0, 1, 2, 3, 4, 0])  # 0 used thrice; 1..4 once each
        assert replay(calls, policy="lfu", capacity=2).hits == 3  # two repeats, then 0 again
        assert replay(calls, policy="lru", capacity=2).hits == 2


class TestSLRU(PolicyContract):
    policy_name = "slru"

    def test_a_key_used_twice_survives_a_scan_of_one_off_keys(self):
        calls = _single([0, 0, 1, 2, 3, 4, 5, 0])
        assert replay(calls, policy="slru", capacity=3).hits == 2
        assert replay(calls, policy="lru", capacity=3).hits == 1

    def test_rejects_a_main_fraction_outside_0_1(self):
        with pytest.raises(ValueError, match="main_fraction"):
            SLRUPolicy(4, main_fraction=0.0)


class TestARC(PolicyContract):
    policy_name = "arc"

    def test_adapts_towards_recency_after_ghost_hits(self):
        policy = make_policy("arc", capacity=2)
        # 0 goes to T2; 2 pushes 1 out of T1 into ghost B1; 1 returns: a B1 ghost hit
        replay(_single([0, 0, 1, 2, 1]), policy=policy, capacity=2)
        assert policy.target == 1.0  # T1's target grew by max(|B2|/|B1|, 1) = 1


class TestLFRU(PolicyContract):
    policy_name = "lfru"

    def test_a_once_hot_key_fades_with_age(self):
        # 0 is used 3 times early, then 1 and 2 alternate: 0's score falls below theirs.
        calls = _single([0, 0, 0, 1, 2, 1, 2, 1, 2, 1, 2, 3, 1, 2])
        lfru = replay(calls, policy="lfru", capacity=3)
        lfu = replay(calls, policy="lfu", capacity=3)
        assert lfru.hits >= lfu.hits


class TestLeastStale(PolicyContract):
    policy_name = "least_stale"

    def test_evicts_what_this_forward_pass_already_used(self):
        # Two layers share 3 slots; pass 0 uses (0,a) then (1,b); pass 1 needs (0,a) again.
        calls = [[("L0", "a")], [("L1", "b")], [("L1", "c")], [("L0", "a")]]
        stale = replay(calls, policy="least_stale", capacity=2, forward_starts=[0, 3])
        lru = replay(calls, policy="lru", capacity=2, forward_starts=[0, 3])
        # At call 2 the pass has used both residents; Least-Stale drops the most recent,
        # ("L1", "b"), and keeps ("L0", "a") for the next pass; LRU drops ("L0", "a").
        assert (stale.hits, lru.hits) == (1, 0)

    def test_is_lru_when_every_call_is_its_own_pass(self):
        calls = [[k % 5, (k * 3) % 7] for k in range(60)]
        assert replay(calls, policy="least_stale", capacity=4) == replay(calls, policy="lru", capacity=4)


class TestGDSF(PolicyContract):
    policy_name = "gdsf"

    def test_keeps_the_expensive_key(self):
        def cost(key):
            return 10.0 if key == "big" else 1.0

        calls = _single(["big", "a", "b", "c", "big"])
        sized = replay(calls, policy=GDSFPolicy(2, cost=cost), capacity=2)
        uniform = replay(calls, policy="gdsf", capacity=2)
        assert (sized.hits, uniform.hits) == (1, 0)


class TestBelady(PolicyContract):
    policy_name = "belady"

    def test_textbook_fault_count(self):
        assert replay(_single(TEXTBOOK), policy="belady", capacity=3).misses == 9

    def test_refuses_calls_that_differ_from_the_future(self):
        policy = make_policy("belady", capacity=2)
        policy.set_future([(0,), (1,)])
        policy.begin_call((0,))
        policy.on_miss(0)
        policy.end_call()
        with pytest.raises(RuntimeError, match="differs"):
            policy.begin_call((2,))


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match="least_stale"):
        make_policy("mru", capacity=2)


def test_non_clairvoyant_policies_refuse_the_future():
    with pytest.raises(TypeError, match="does not take the future"):
        make_policy("lru", capacity=2).set_future([(0,)])


@pytest.mark.parametrize("name", ["lfu", "lfru", "least_stale", "gdsf", "belady"])
def test_ranking_only_the_head_of_a_large_cache_changes_nothing(name):
    """Ranked policies sort only the head of the order; a full sort must agree exactly."""
    policy_class = POLICIES[name]

    class FullSort(policy_class):
        def _order(self, wanted):
            return super()._order(len(self._keys))

        def snapshot(self):  # no state copied a call, as for the built-in policy: a subclass's
            return None  # default deep copy of belady's whole future made this test take 47 s

    generator = random.Random(name)
    calls = [generator.sample(range(300), generator.randint(1, 6)) for _ in range(1500)]
    starts = range(0, 1500, 7)
    fast = replay(calls, policy=name, capacity=60, forward_starts=starts)
    full = replay(calls, policy=FullSort(60), capacity=60, forward_starts=starts)
    assert fast == full and fast.evictions > 1000
    # a shared pool, where the keys of layers at their share use up the short list
    layer_of = lambda key: key // 100  # noqa: E731
    shared = [[100 * (index % 3) + key % 100 for key in call] for index, call in enumerate(calls)]
    fast = replay(shared, policy=name, capacity=60, forward_starts=starts, num_layers=3, layer_of=layer_of)
    full = replay(shared, policy=FullSort(60), capacity=60, forward_starts=starts, num_layers=3, layer_of=layer_of)
    assert fast == full and fast.evictions > 1000
