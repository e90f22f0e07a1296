"""The core used the wrong way (an adversarial pass): a clear error, and the cache as before.

* closing (or collecting) an overlapped device-mode ``passes`` generator that a later
  overlapped call has superseded leaves that later call alone: a prefetch is still refused
  while the later call owes its misses pass, and the later call completes, right;
* a second thread that tries to begin an overlapped call while an overlapped call is inside
  the pool gets `ConcurrentUseError` and changes nothing: the call in flight completes,
  right, as if the other thread had never knocked;
* `SlotPool.attach` checks its ``global_to_local`` map (a 1-D int tensor, every local
  expert exactly once, nothing outside ``[-1, E)``) before it changes anything: a bad map
  used to be taken, and then read slots and store rows that do not exist;
* a layer name that cannot be a dict key is refused by name, not by a bare ``unhashable
  type`` from inside the pool;
* ``prefetch`` ids of the wrong number of dimensions are refused saying what it takes
  (``[N]`` or ``[T, K]``), not as if only ``[T, K]`` would do;
* reading a view (``stats``) from another thread while a prefetch's copies are pending
  leaves them pending, so the pool's next call still joins them on its own stream (GPU).
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import devices
from helpers import random_weights, same_bytes, slot_bytes, views

import expertcache.device_overlap as device_overlap
from expertcache import CachedWeightProvider, ConcurrentUseError, SlotPool
from expertcache.layout import layout_from_weights
from expertcache.reference import moe_forward
from expertcache.store import CPUBackingStore

E, HIDDEN, INTER = 8, 16, 8


def summed_passes(results, hidden, router):
    """``moe_forward`` summed over a call's pass results (each pass's other ids are -1)."""
    return sum(moe_forward(hidden, r.w1, r.w2, router, r.topk_ids) for r in results)


def reference(weights, hidden, router, ids, device):
    full = {name: tensor.to(device) for name, tensor in weights.items()}
    return moe_forward(hidden, full["w1"], full["w2"], router, ids)


@pytest.mark.parametrize("device", devices())
def test_closing_a_superseded_overlapped_call_leaves_the_later_call_its_slots(device):
    gen = torch.Generator().manual_seed(3)
    weights = random_weights(E, HIDDEN, INTER, generator=gen)
    provider = CachedWeightProvider(weights, cache_size=4, mode="device", device=device)
    provider.prepare(torch.tensor([[0, 1]], device=device))
    stale = provider.passes(torch.tensor([[0, 2]], device=device), overlap=True)
    next(stale)  # its hits; its misses are owed
    ids = torch.tensor([[1, 3]], device=device)
    hidden = torch.randn(1, HIDDEN, generator=gen).to(device)
    router = torch.rand(1, 2, generator=gen).to(device)
    later = provider.passes(ids, overlap=True)
    first = next(later)  # the later call's hits; its misses are owed now
    out = moe_forward(hidden, first.w1, first.w2, router, first.topk_ids)
    stale.close()  # the superseded call ends; the later one still owes its misses
    state = views(provider), slot_bytes(provider.pool)
    with pytest.raises(RuntimeError, match="has yet to yield a pass"):
        provider.prefetch(torch.tensor([4, 5, 6, 7], device=device))
    assert views(provider) == state[0] and same_bytes(slot_bytes(provider.pool), state[1])
    out = out + summed_passes(later, hidden, router)  # completes: no call came between
    assert torch.equal(out, reference(weights, hidden, router, ids, device))


@pytest.mark.parametrize("device", devices())
def test_a_thread_refused_at_an_overlapped_call_changes_nothing(monkeypatch, device):
    gen = torch.Generator().manual_seed(4)
    weights = random_weights(E, HIDDEN, INTER, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]], device=device)  # 6 experts in 4 slots: 3 overlapped passes
    hidden = torch.randn(3, HIDDEN, generator=gen).to(device)
    router = torch.rand(3, 2, generator=gen).to(device)
    alone = CachedWeightProvider(weights, cache_size=4, mode="device", device=device)
    expected = summed_passes(alone.passes(ids, overlap=True), hidden, router)
    provider = CachedWeightProvider(weights, cache_size=4, mode="device", device=device)
    refused: list[BaseException] = []
    real_admit = device_overlap.admit  # an overlapped call admits there

    def knocking(*args, **kwargs):  # another thread begins an overlapped call while this one admits
        def other() -> None:
            try:
                next(provider.passes(torch.tensor([[6, 7]], device=device), overlap=True))
            except BaseException as error:  # noqa: BLE001 - recorded, checked below
                refused.append(error)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(30)
        return real_admit(*args, **kwargs)

    monkeypatch.setattr(device_overlap, "admit", knocking)
    out = summed_passes(provider.passes(ids, overlap=True), hidden, router)
    monkeypatch.undo()
    assert refused and all(isinstance(error, ConcurrentUseError) for error in refused)
    assert torch.equal(out, expected)
    assert views(provider) == views(alone)
    assert same_bytes(slot_bytes(provider.pool), slot_bytes(alone.pool))


def _store(weights, pin=False):
    return CPUBackingStore(layout_from_weights(weights)[1], weights, pin=pin)


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize(
    "mapping, error, message",
    [
        (torch.tensor([0, 1, 2, 3, 4, 5, 6, 100], dtype=torch.int32), ValueError, "local indices must be 0..7"),
        (torch.tensor([-5, 1, 2, 3, 4, 5, 6, 7]), ValueError, "local expert index or -1"),
        (torch.arange(4), ValueError, "local indices must be 0..7"),  # experts 4..7 out of reach
        (torch.arange(8).reshape(2, 4), ValueError, "1-D"),
        (torch.arange(8.0), TypeError, "int32 or int64"),  # truncated to ints before
    ],
)
def test_attach_refuses_a_bad_global_to_local_map_and_changes_nothing(mode, mapping, error, message):
    weights = random_weights(E, HIDDEN, INTER, generator=torch.Generator().manual_seed(5))
    device = "cuda" if mode == "device" and torch.cuda.is_available() else "cpu"  # else interpreted
    pool = SlotPool.for_weights(weights, 4, device=device, mode=mode)
    pin = device == "cuda"  # a GPU pool serves pinned stores only
    with pytest.raises(error, match=message):
        pool.attach("a", _store(weights, pin), mapping)
    assert not pool.layers
    layer = pool.attach("a", _store(weights, pin), torch.arange(E, dtype=torch.int32))  # the pool serves on
    assert pool.prepare(layer, torch.tensor([[0, 7]], device=device)).tolist() == [[0, 1]]


@pytest.mark.parametrize("failing", ["copy_groups", "allocate"])
def test_an_attach_that_fails_leaves_its_policy_free_and_the_pool_as_before(monkeypatch, failing):
    """The first attach binds the pool's policy instance; one that fails later (copy groups,
    table allocation: out of memory) left the instance bound to a pool that serves nothing,
    so no other pool could take it."""
    from expertcache import pool_layers
    from expertcache.kernels.slot_tables import SlotTables
    from expertcache.policies import LRUPolicy

    weights = random_weights(E, HIDDEN, INTER, generator=torch.Generator().manual_seed(9))
    policy = LRUPolicy(4)
    pool = SlotPool.for_weights(weights, 4, device="cpu", policy=policy)
    tables = pool.tables

    def fail(*args, **kwargs):
        raise MemoryError("injected")

    if failing == "copy_groups":
        monkeypatch.setattr(pool_layers, "copy_groups", fail)
    else:
        monkeypatch.setattr(SlotTables, "allocate", fail)
    with pytest.raises(MemoryError, match="injected"):
        pool.attach("a", _store(weights, False), torch.arange(E, dtype=torch.int32))
    monkeypatch.undo()
    assert not pool.layers and pool.tables is tables and pool.key_layer is None
    other = SlotPool.for_weights(weights, 4, device="cpu", policy=policy)  # the instance is free
    layer = other.attach("a", _store(weights, False), torch.arange(E, dtype=torch.int32))
    assert other.prepare(layer, torch.tensor([[0, 7]])).tolist() == [[0, 1]]


def test_a_layer_name_that_is_no_dict_key_is_refused_by_name():
    weights = random_weights(E, HIDDEN, INTER, generator=torch.Generator().manual_seed(6))
    pool = SlotPool.for_weights(weights, 4, device="cpu")
    with pytest.raises(TypeError, match="layer name must be hashable"):
        CachedWeightProvider(weights, pool=pool, layer=["a"])
    assert not pool.layers
    CachedWeightProvider(weights, pool=pool, layer=("a",)).prepare(torch.tensor([[1]]))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", [(), (1, 1, 2)])
def test_prefetch_ids_of_other_dimensions_are_refused_saying_what_it_takes(device, shape):
    weights = random_weights(E, HIDDEN, INTER, generator=torch.Generator().manual_seed(7))
    provider = CachedWeightProvider(weights, cache_size=4, mode="device", device=device)
    with pytest.raises(ValueError, match=r"expert_ids must be 1-D \[N\] or 2-D \[T, K\]"):
        provider.prefetch(torch.zeros(shape, dtype=torch.int64, device=device))
    assert provider.prefetch_stats.calls == 0 and provider.resident() == frozenset()


@pytest.mark.gpu
def test_reading_stats_on_another_thread_leaves_a_prefetch_for_the_next_call_to_join():
    """The views used to join the copy stream for the reading thread only, and mark the
    copies joined: a metrics thread's scrape let the next call skip its wait for them."""
    gen = torch.Generator().manual_seed(5)
    weights = random_weights(E, HIDDEN, INTER, generator=gen)
    provider = CachedWeightProvider(weights, cache_size=4, mode="device", device="cuda")
    provider.prepare(torch.tensor([[0, 1]], device="cuda"))
    provider.prefetch(torch.tensor([5, 6], device="cuda"))
    assert provider.pool.copies_pending
    reader = threading.Thread(target=lambda: provider.stats)
    reader.start()
    reader.join()
    assert provider.pool.copies_pending  # still the next call's to join
    ids = torch.tensor([[5, 6], [6, 2]], device="cuda")
    hidden, router = torch.randn(2, HIDDEN, generator=gen).cuda(), torch.rand(2, 2, generator=gen).cuda()
    result = provider.prepare(ids)
    full = {name: tensor.cuda() for name, tensor in weights.items()}
    assert torch.equal(
        moe_forward(hidden, result.w1, result.w2, router, result.topk_ids),
        moe_forward(hidden, full["w1"], full["w2"], router, ids),
    )
    assert provider.prefetch_stats.misses == 2 and provider.stats.hits == 2
