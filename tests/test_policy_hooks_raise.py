"""A policy of one's own whose hook raises takes the whole call back.

The hooks (``on_hit``, ``on_evict``, ``on_miss``, ``end_call``) run once a call's copies and
tables are committed. If one raises, the host-mode cache puts back the slots the call
overwrote, its tables and counters, and the policy as its ``snapshot()`` before the call
left it; the trace simulator's `SlotTable` hears the hooks before it changes its table.
Either keeps working and then decides exactly as a twin that never saw the failed call.
A policy whose state a deep copy cannot take is refused when a cache claims it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import random_weights, same_bytes, slot_bytes, views

from expertcache import CachedWeightProvider
from expertcache.policies import POLICIES, LRUPolicy, make_policy
from expertcache.reference import moe_forward
from expertcache.slot_table import SlotTable

EXPERTS, HIDDEN, INTER = 8, 16, 8


class FailingHooks(LRUPolicy):
    """LRU that keeps a log of its hooks and, while ``armed``, raises in ``hook`` for ``fail_on``."""

    name = "failing_hooks"

    def __init__(self, capacity):
        super().__init__(capacity)
        self.armed, self.fail_on, self.hook, self.heard = False, None, "on_miss", []

    def _heard(self, hook, key):
        self.heard.append((hook, key))
        if self.armed and key == self.fail_on and hook == self.hook:
            raise RuntimeError(f"{hook} failed on {key}")

    def on_hit(self, key):
        super().on_hit(key)
        self._heard("on_hit", key)

    def on_miss(self, key):
        super().on_miss(key)
        self._heard("on_miss", key)

    def on_evict(self, key):
        super().on_evict(key)
        self._heard("on_evict", key)

    def end_call(self):
        super().end_call()
        self._heard("end_call", None)


def policy_state(policy):
    return list(policy._order), list(policy.heard)


def host_cache(weights, policy):
    return CachedWeightProvider(weights, cache_size=3, mode="host", device="cpu", policy=policy)


@pytest.mark.parametrize(
    "fail_on, hook, ids",
    [
        (6, "on_miss", [[4, 6]]),  # the second miss, after an eviction and a whole miss were heard
        (2, "on_hit", [[4, 2]]),  # a hit after a miss
        (None, "end_call", [[6, 7]]),  # every key heard, then the end
        ("victim", "on_evict", [[4, 6]]),  # the first eviction, before any miss was heard
    ],
    ids=["on_miss", "on_hit", "end_call", "on_evict"],
)
def test_a_host_call_whose_hook_raises_changes_nothing(fail_on, hook, ids):
    gen = torch.Generator().manual_seed(0)
    weights = random_weights(EXPERTS, HIDDEN, INTER, generator=gen)
    failing, twin = FailingHooks(3), FailingHooks(3)
    cache, other = host_cache(weights, failing), host_cache(weights, twin)
    for warm in ([[0, 1]], [[2, 3]], [[5, 2]]):  # full, with evictions behind it
        for provider in (cache, other):
            provider.prepare(torch.tensor(warm))
    failing.fail_on = next(iter(failing._order)) if fail_on == "victim" else fail_on  # least recent: evicted first
    failing.hook, failing.armed = hook, True
    before, slots, state = views(cache), slot_bytes(cache.pool), policy_state(failing)
    with pytest.raises(RuntimeError, match=f"{hook} failed"):
        cache.prepare(torch.tensor(ids))
    assert views(cache) == before and policy_state(failing) == state
    assert same_bytes(slot_bytes(cache.pool), slots)
    failing.armed = False
    for step in range(12):  # then it decides and serves as the twin that never saw that call
        call = torch.randint(0, EXPERTS, (2, 1), generator=gen).unique().reshape(1, -1)
        hidden, router = torch.randn(1, HIDDEN, generator=gen), torch.rand(call.shape, generator=gen)
        result = cache.prepare(call)
        other.prepare(call)
        assert views(cache) == views(other), step
        assert torch.equal(
            moe_forward(hidden, result.w1, result.w2, router, result.topk_ids),
            moe_forward(hidden, weights["w1"], weights["w2"], router, call),
        )
    assert failing._order == twin._order


def test_a_simulated_call_whose_hook_raises_changes_nothing():
    failing, twin = FailingHooks(3), FailingHooks(3)
    table, other = SlotTable(3, policy=failing), SlotTable(3, policy=twin)
    for keys in ([0, 1], [2, 3], [5, 2]):
        table.admit(keys)
        other.admit(keys)
    failing.armed, failing.fail_on = True, 4
    resident, slots, state = table.resident(), [table.slot_of(k) for k in range(EXPERTS)], policy_state(failing)
    with pytest.raises(RuntimeError, match="on_miss failed on 4"):
        table.admit([4, 6])
    assert table.resident() == resident and [table.slot_of(k) for k in range(EXPERTS)] == slots
    assert policy_state(failing) == state
    failing.armed = False
    for keys in ([4, 6], [0, 7], [1, 2], [6, 3]):
        assert table.admit(keys) == other.admit(keys)
        assert table.resident() == other.resident()


class HoldsALock(LRUPolicy):
    name = "holds_a_lock"

    def __init__(self, capacity):
        super().__init__(capacity)
        self.lock = threading.Lock()


class HoldsALockAndSnapshots(HoldsALock):
    name = "holds_a_lock_and_snapshots"

    def snapshot(self):
        return list(self._order)

    def restore(self, state):
        self._order = type(self._order).fromkeys(state)
        self._scan = None


def test_a_policy_a_deep_copy_cannot_take_is_refused_when_claimed():
    weights = random_weights(EXPERTS, HIDDEN, INTER, generator=torch.Generator().manual_seed(1))
    policy = HoldsALock(3)
    with pytest.raises(TypeError, match=r"HoldsALock.snapshot\(\) failed .*override snapshot\(\) and restore\(\)"):
        host_cache(weights, policy)
    with pytest.raises(TypeError, match="snapshot"):
        SlotTable(3, policy=policy)
    assert getattr(policy, "_owner", None) is None  # not bound: it can still go to a cache
    cache = host_cache(weights, HoldsALockAndSnapshots(3))
    cache.prepare(torch.tensor([[0, 1]]))
    assert cache.resident() == {0, 1}


def test_only_policies_written_elsewhere_are_copied_a_call():
    for name in POLICIES:
        assert make_policy(name, capacity=4).snapshot() is None, name  # built-in: no copy a call
    state = FailingHooks(4).snapshot()
    assert isinstance(state, dict) and state["heard"] == [] and state["capacity"] == 4
