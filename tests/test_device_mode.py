"""Device-driven admission makes exactly the host LRU's decisions.

A hypothesis state machine drives a host-mode and a device-mode pool (shared by 1-3
layers, with an EP expert map) through the same random calls: decode-sized ones, calls of
more ids than the register kernel takes, and calls of more ids than slots (read on the
host in device mode too). After every call: equal hits, misses, evictions (so equal
victims), equal expert <-> slot tables, equal remapped ids, and byte-identical slot
tensors. Runs interpreted on a CPU, compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import random_topk, random_weights, same_bytes, slot_bytes
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from expertcache import CacheCapacityError, CachedWeightProvider, SlotPool

STEPS = {"count": 0}
MODES = ("host", "device")


class HostVersusDevice(RuleBasedStateMachine):
    device = "cpu"

    @initialize(num_local=st.integers(2, 9), num_layers=st.integers(1, 3), data=st.data())
    def build(self, num_local, num_layers, data):
        num_global = num_local + data.draw(st.integers(0, 3), label="remote experts")
        local_ids = data.draw(st.permutations(range(num_global)), label="placement")[:num_local]
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[torch.tensor(local_ids)] = torch.arange(num_local, dtype=torch.int32)
        self.num_global = num_global
        slots = data.draw(st.integers(num_layers, num_local * num_layers), label="slots")
        weights = [random_weights(num_local, 8, 4, extras=True) for _ in range(num_layers)]
        self.pools = [SlotPool.for_weights(weights[0], slots, device=self.device, mode=mode) for mode in MODES]
        self.layers = [
            [CachedWeightProvider(w, pool=pool, layer=i, expert_map=expert_map) for i, w in enumerate(weights)]
            for pool in self.pools
        ]

    def _both(self, layer, ids):
        outcomes = []
        for providers in self.layers:
            try:
                outcomes.append(providers[layer].prepare(ids).topk_ids)
            except CacheCapacityError as error:
                outcomes.append(error.needed)
        if isinstance(outcomes[0], torch.Tensor):
            assert torch.equal(outcomes[0], outcomes[1])
        else:
            assert outcomes[0] == outcomes[1]

    @rule(data=st.data())
    def call(self, data):
        STEPS["count"] += 1
        layer = data.draw(st.integers(0, len(self.layers[0]) - 1), label="layer")
        share = self.pools[0].share
        tokens = data.draw(st.integers(1, min(3, share)), label="tokens")
        top_k = data.draw(st.integers(1, max(1, min(self.num_global, share // tokens))), label="top_k")
        seed = data.draw(st.integers(0, 2**16), label="seed")
        ids = random_topk(tokens, top_k, self.num_global, generator=torch.Generator().manual_seed(seed))
        self._both(layer, ids.to(self.device, torch.int32 if seed % 2 else torch.int64))

    @rule(data=st.data())
    def prefill_call(self, data):
        """More ids than the share (T * K > S // layers): read on the host in both modes, may not fit."""
        STEPS["count"] += 1
        layer = data.draw(st.integers(0, len(self.layers[0]) - 1), label="layer")
        tokens = self.pools[0].share + data.draw(st.integers(1, 4), label="extra tokens")
        seed = data.draw(st.integers(0, 2**16), label="seed")
        ids = random_topk(tokens, 1, self.num_global, generator=torch.Generator().manual_seed(seed))
        self._both(layer, ids.to(self.device))

    @rule(data=st.data())
    def large_call(self, data):
        """More ids than the register kernel takes (> 64): the scatter-min kernel."""
        STEPS["count"] += 1
        layer = data.draw(st.integers(0, len(self.layers[0]) - 1), label="layer")
        distinct = data.draw(
            st.lists(st.integers(0, self.num_global - 1), min_size=1, max_size=self.pools[0].share, unique=True)
        )
        ids = data.draw(st.lists(st.sampled_from(distinct), min_size=65, max_size=90), label="ids")
        self._both(layer, torch.tensor(ids + distinct, device=self.device).reshape(-1, 1))

    @invariant()
    def same_state(self):
        if not hasattr(self, "pools"):
            return
        host_layers, device_layers = self.layers
        for host, device in zip(host_layers, device_layers, strict=True):
            assert host.stats == device.stats
            assert [host.slot_of(e) for e in range(host.num_experts)] == [
                device.slot_of(e) for e in range(device.num_experts)
            ]
            assert [host.expert_in(s) for s in range(host.pool.num_slots)] == [
                device.expert_in(s) for s in range(device.pool.num_slots)
            ]
        assert same_bytes(slot_bytes(self.pools[0]), slot_bytes(self.pools[1]))


@pytest.mark.parametrize("device", devices())
def test_device_admission_equals_host_lru(device):
    STEPS["count"] = 0
    machine = type("Machine", (HostVersusDevice,), {"device": device})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=25, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )
    assert STEPS["count"] >= 300, STEPS["count"]


@pytest.mark.parametrize("device", devices())
def test_pool_of_more_than_1024_slots(device):
    """1,100 slots shared by 3 layers of 400 experts: host and device decide alike past 1024."""
    gen = torch.Generator().manual_seed(11)
    weights = [random_weights(400, 4, 2, generator=gen) for _ in range(3)]
    pools = [SlotPool.for_weights(weights[0], 1100, device=device, mode=mode) for mode in MODES]
    layers = [[CachedWeightProvider(w, pool=pool, layer=i) for i, w in enumerate(weights)] for pool in pools]
    highest = 0
    for call in range(12):
        ids = torch.randint(0, 400, (60, 5), generator=gen).to(device)  # up to 300 distinct experts
        host, dev = (providers[call % 3].prepare(ids) for providers in layers)
        assert torch.equal(host.topk_ids, dev.topk_ids)
        highest = max(highest, int(host.topk_ids.max()))
    assert highest >= 1024  # slots past 1024 were really used
    for host, dev in zip(*layers, strict=True):
        assert host.stats == dev.stats and host.stats.evictions > 0
        assert host.resident() == dev.resident()
    assert same_bytes(slot_bytes(pools[0]), slot_bytes(pools[1]))


@pytest.mark.parametrize("device", devices())
def test_invalid_ids_map_to_minus_one_and_are_counted(device):
    provider = CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, device=device, mode="device")
    result = provider.prepare(torch.tensor([[1, 7]], device=device))
    assert result.topk_ids.tolist() == [[0, -1]]
    assert provider.stats.invalid_ids == 1 and provider.resident() == {1}
    # checked in the ids' own dtype: 2**32 + 3 is out of range, not expert 3
    result = provider.prepare(torch.tensor([[2**32 + 3, 1]], device=device))
    assert result.topk_ids.tolist() == [[-1, 0]]
    assert provider.stats.invalid_ids == 2 and provider.resident() == {1}


def test_device_mode_rejects_other_policies():
    with pytest.raises(ValueError, match="device mode implements only"):
        CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, mode="device", policy="fifo")
    with pytest.raises(ValueError, match="mode must be one of"):
        CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, mode="gpu")
