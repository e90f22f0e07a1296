"""`CopyPacer`: chunked copies land the same bytes; a chunk waits for a running collective."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import random_topk, random_weights

from expertcache import CachedWeightProvider
from expertcache.parallel import CopyPacer


class FakeWork:
    """A collective whose completion the test decides."""

    def __init__(self, completed: bool) -> None:
        self.completed = completed
        self.waits = 0

    def is_completed(self) -> bool:
        return self.completed

    def wait(self) -> bool:
        self.waits += 1
        self.completed = True
        return True


@pytest.mark.parametrize("world_size, enabled", [(1, True), (2, False), (1, False)])
def test_pacing_stays_off_unless_asked_with_several_ranks(world_size, enabled):
    assert not CopyPacer(world_size=world_size, enabled=enabled).engaged
    assert CopyPacer(world_size=2, enabled=True).engaged


# chunk sizes: 1 byte, uneven, exactly w1 (256 bytes; w2 is 128), twice w1, larger than both
@pytest.mark.parametrize("chunk_bytes", [1, 100, 256, 512, 10_000], ids=str)
def test_chunked_copies_fill_slots_byte_for_byte(chunk_bytes):
    gen = torch.Generator().manual_seed(chunk_bytes)
    weights = random_weights(6, 8, 4, generator=gen)
    provider = CachedWeightProvider(weights, cache_size=3, device="cpu")
    pacer = CopyPacer(world_size=2, enabled=True, chunk_bytes=chunk_bytes)
    pacer.install(provider.pool)
    for _ in range(20):
        result = provider.prepare(random_topk(1, 2, 6, generator=gen))
        for expert in provider.resident():
            slot = provider.slot_of(expert)
            assert torch.equal(result.w1[slot], weights["w1"][expert])
            assert torch.equal(result.w2[slot], weights["w2"][expert])
    sizes = [spec.nbytes for spec in provider.pool.layout.specs]
    assert sizes == [256, 128]
    assert pacer.stats.experts == provider.stats.misses
    assert pacer.stats.chunks == provider.stats.misses * sum(math.ceil(size / chunk_bytes) for size in sizes)
    assert pacer.stats.holds == 0  # nothing was in flight


def test_a_chunk_waits_once_for_a_running_collective():
    pacer = CopyPacer(world_size=2, enabled=True, chunk_bytes=4)
    destination, source = torch.zeros(16, dtype=torch.uint8), torch.arange(16, dtype=torch.uint8)
    running = FakeWork(completed=False)
    pacer.track(running)
    pacer.copy([(destination, source)])
    assert torch.equal(destination, source)
    assert running.waits == 1 and pacer.stats.holds == 1 and pacer.stats.chunks == 4


def test_a_finished_or_released_collective_holds_nothing():
    pacer = CopyPacer(world_size=2, enabled=True, chunk_bytes=8)
    finished = FakeWork(completed=True)
    pacer.track(finished)
    pacer.copy([(torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8))])
    running = FakeWork(completed=False)
    pacer.track(running)
    pacer.release()
    pacer.copy([(torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8))])
    assert finished.waits == running.waits == pacer.stats.holds == 0


def test_a_disengaged_pacer_leaves_the_pool_alone():
    provider = CachedWeightProvider(random_weights(2, 8, 4), cache_size=1, device="cpu")
    before = provider.pool.copy_expert
    CopyPacer(world_size=1, enabled=True).install(provider.pool)
    assert provider.pool.copy_expert is before


@pytest.mark.parametrize("chunk_bytes, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_chunk_sizes_are_refused(chunk_bytes, error):
    with pytest.raises(error, match="chunk_bytes"):
        CopyPacer(world_size=2, enabled=True, chunk_bytes=chunk_bytes)
