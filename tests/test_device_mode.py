"""Device-driven admission makes exactly the host LRU's decisions.

A hypothesis state machine drives a host-mode and a device-mode pool (shared by 1-3
layers, with an EP expert map) through the same random calls. After every call: equal
hits, misses, evictions (so equal victims), equal expert <-> slot tables, equal remapped
ids, and byte-identical slot records. Runs interpreted on a CPU, compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import random_topk, random_weights
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from expertcache import CacheCapacityError, CachedWeightProvider, SlotPool
from expertcache.kernels.copy_records import copy_planned_records, copy_planned_records_torch
from expertcache.slot_pool import DeviceSlotPool

STEPS = {"count": 0}


class HostVersusDevice(RuleBasedStateMachine):
    device = "cpu"

    @initialize(num_local=st.integers(2, 9), num_layers=st.integers(1, 3), data=st.data())
    def build(self, num_local, num_layers, data):
        num_global = num_local + data.draw(st.integers(0, 3), label="remote experts")
        local_ids = data.draw(st.permutations(range(num_global)), label="placement")[:num_local]
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[torch.tensor(local_ids)] = torch.arange(num_local, dtype=torch.int32)
        self.num_global = num_global
        slots = data.draw(st.integers(1, num_local * num_layers), label="slots")
        weights = [random_weights(num_local, 8, 4, extras=True) for _ in range(num_layers)]
        self.pools = [
            SlotPool.for_weights(weights[0], slots, device=self.device),
            DeviceSlotPool(SlotPool.for_weights(weights[0], 1).layout, slots, device=self.device),
        ]
        self.layers = [
            [CachedWeightProvider(w, pool=pool, layer=i, expert_map=expert_map) for i, w in enumerate(weights)]
            for pool in self.pools
        ]

    @rule(data=st.data())
    def call(self, data):
        STEPS["count"] += 1
        layer = data.draw(st.integers(0, len(self.layers[0]) - 1), label="layer")
        num_slots = self.pools[0].num_slots
        tokens = data.draw(st.integers(1, min(3, num_slots)), label="tokens")
        top_k = data.draw(st.integers(1, max(1, min(self.num_global, num_slots // tokens))), label="top_k")
        seed = data.draw(st.integers(0, 2**16), label="seed")
        ids = random_topk(tokens, top_k, self.num_global, generator=torch.Generator().manual_seed(seed))
        ids = ids.to(self.device, torch.int32 if seed % 2 else torch.int64)
        host, device = (providers[layer].prepare(ids) for providers in self.layers)
        assert torch.equal(host.topk_ids, device.topk_ids)

    @rule(data=st.data())
    def prefill_call(self, data):
        """More ids than slots: device mode checks on the host, raising like host mode."""
        STEPS["count"] += 1
        num_slots = self.pools[0].num_slots
        seed = data.draw(st.integers(0, 2**16), label="seed")
        ids = random_topk(num_slots + 1, 1, self.num_global, generator=torch.Generator().manual_seed(seed))
        outcomes = []
        for providers in self.layers:
            try:
                outcomes.append(providers[0].prepare(ids.to(self.device)).topk_ids)
            except CacheCapacityError as error:
                outcomes.append(error.needed)
        if isinstance(outcomes[0], torch.Tensor):
            assert torch.equal(outcomes[0], outcomes[1])
        else:
            assert outcomes[0] == outcomes[1]

    @rule(data=st.data())
    def large_call(self, data):
        """More ids than the register kernel takes (> 64): the scatter-min kernel, then the copy launch."""
        STEPS["count"] += 1
        layer = data.draw(st.integers(0, len(self.layers[0]) - 1), label="layer")
        distinct = data.draw(
            st.lists(st.integers(0, self.num_global - 1), min_size=1, max_size=self.pools[0].num_slots, unique=True)
        )
        ids = data.draw(st.lists(st.sampled_from(distinct), min_size=65, max_size=90), label="ids")
        ids = torch.tensor(ids + distinct, device=self.device).reshape(-1, 1)
        host, device = (providers[layer].prepare(ids) for providers in self.layers)
        assert torch.equal(host.topk_ids, device.topk_ids)

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
        assert torch.equal(self.pools[0].records, self.pools[1].records)


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
def test_invalid_ids_map_to_minus_one_and_are_counted(device):
    provider = CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, device=device, mode="device")
    result = provider.prepare(torch.tensor([[1, 7]], device=device))
    assert result.topk_ids.tolist() == [[0, -1]]
    assert provider.stats.invalid_ids == 1 and provider.resident() == {1}


@pytest.mark.parametrize("device", devices())
def test_copy_kernel_matches_reference(device):
    gen = torch.Generator().manual_seed(5)
    source = torch.randint(0, 256, (9, 1024), generator=gen, dtype=torch.uint8)
    if device == "cuda":
        source = source.pin_memory()
    expected = torch.randint(0, 256, (6, 1024), generator=gen, dtype=torch.uint8).to(device)
    slots = expected.clone()
    plan_expert = torch.tensor([8, 0, 3, 0, 0, 0], dtype=torch.int32, device=device)
    plan_slot = torch.tensor([2, 5, 0, 0, 0, 0], dtype=torch.int32, device=device)
    count = torch.tensor([3], dtype=torch.int32, device=device)
    copy_planned_records(source, slots, plan_expert, plan_slot, count, num_programs=4, block=64)
    copy_planned_records_torch(source, expected, plan_expert, plan_slot, count)
    assert torch.equal(slots, expected)
    assert torch.equal(slots[2].cpu(), source[8]) and torch.equal(slots[1], expected[1])


def test_device_mode_rejects_other_policies():
    with pytest.raises(ValueError, match="device mode implements only"):
        CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, mode="device", policy="fifo")
    with pytest.raises(ValueError, match="mode must be one of"):
        CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, mode="gpu")
