"""Fault injection: a call that fails half-way leaves the cache exactly as before.

Each test makes one step of ``prepare`` fail after the steps before it have run (a copy
that raises after writing part of a slot, a commit launch that raises after every copy, a
KeyboardInterrupt between device admission and its copy), then checks stats, tables,
``resident()``, ``slot_of()``, ``expert_in()`` and every slot byte against the state
before the call, and that the next call equals the full-weights reference.
"""

from __future__ import annotations

import signal
import threading

import pytest
import torch
from conftest import devices
from helpers import random_weights, same_bytes, slot_bytes, views

import expertcache.device_overlap as device_overlap
import expertcache.device_prepare as device_prepare
import expertcache.host_prepare as host_prepare
from expertcache import CachedWeightProvider
from expertcache.reference import moe_forward

E = 8


def snapshot(provider):
    return views(provider), slot_bytes(provider.pool)


def assert_unchanged(provider, before):
    now = snapshot(provider)
    assert now[0] == before[0]
    assert same_bytes(now[1], before[1]), "slot bytes changed"


def assert_next_call_is_right(provider, weights, device):
    ids = torch.tensor([[6, 1], [7, 2]], device=device)
    result = provider.prepare(ids)
    hidden, router = torch.randn(2, 16, device=device), torch.rand(2, 2, device=device)
    full = {k: v.to(device) for k, v in weights.items()}
    assert torch.equal(
        moe_forward(hidden, result.w1, result.w2, router, result.topk_ids),
        moe_forward(hidden, full["w1"], full["w2"], router, ids),
    )


def warm(device, mode, **kwargs):
    weights = random_weights(E, 16, 8, extras=True, generator=torch.Generator().manual_seed(3))
    provider = CachedWeightProvider(weights, cache_size=4, device=device, mode=mode, **kwargs)
    for ids in ([[0, 1], [2, 3]], [[4, 0]]):  # full pool; the next misses evict
        provider.prepare(torch.tensor(ids, device=device))
    return weights, provider


def fail_after(real, failure):
    def wrapper(*args, **kwargs):
        real(*args, **kwargs)  # the work is enqueued (bytes written, tables changed), then it fails
        raise failure("injected")

    return wrapper


def fail_before(real, failure):
    def wrapper(*args, **kwargs):
        raise failure("injected")  # a launch that raises enqueues nothing

    return wrapper


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize(
    "mode, module, step, when",
    [
        ("host", host_prepare, "copy_with_engine", fail_before),  # between the plan and the first copy
        ("host", host_prepare, "copy_with_engine", fail_after),  # a copy fails after its bytes landed
        ("host", host_prepare, "commit_plan", fail_before),  # every copy done, the commit launch fails
        ("host", host_prepare, "commit_plan", fail_after),  # the commit ran, then its launcher raised
        ("device", device_prepare, "admit", fail_after),  # tables updated on the device, then a failure
        ("device", device_prepare, "copy_with_kernel", fail_before),  # between admission and copy
        ("device", device_prepare, "copy_with_kernel", fail_after),  # after the copy's bytes landed
    ],
)
@pytest.mark.parametrize("overlap", [False, True], ids=["prepare", "overlapped passes"])
def test_a_failing_step_rolls_back(monkeypatch, device, failure, mode, module, step, when, overlap):
    if overlap and module is device_prepare:
        module = device_overlap  # overlapped device-mode passes launch their kernels there
    weights, provider = warm(device, mode)
    before = snapshot(provider)
    monkeypatch.setattr(module, step, when(getattr(module, step), failure))
    ids = torch.tensor([[5, 6], [7, 0]], device=device)  # 3 misses, 3 evictions
    with pytest.raises(failure, match="injected"):
        # overlapped (device mode): the copies go to the pool's copy stream
        provider.passes(ids, overlap=True).__next__() if overlap else provider.prepare(ids)
    monkeypatch.undo()
    assert_unchanged(provider, before)
    assert_next_call_is_right(provider, weights, device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("step", ["copy_with_engine", "commit_plan"])
def test_a_failing_later_pass_rolls_back_to_the_pass_before(monkeypatch, device, step):
    """Host mode's pass 1 plans without reading the state again; when it fails, the state is
    restored from its on-device snapshot: exactly as pass 0 left it."""
    weights, provider = warm(device, "host")
    passes = provider.passes(torch.arange(E, device=device).reshape(4, 2))  # 8 experts, 4 slots: 2 passes
    next(passes)  # the 4 resident experts, nothing copied
    before = snapshot(provider)
    monkeypatch.setattr(host_prepare, step, fail_after(getattr(host_prepare, step), RuntimeError))
    with pytest.raises(RuntimeError, match="injected"):
        next(passes)  # pass 1: 4 misses, 4 evictions; its copies (or its commit) ran, then raised
    monkeypatch.undo()
    assert_unchanged(provider, before)
    assert_next_call_is_right(provider, weights, device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("when", [fail_before, fail_after])
def test_a_failing_engine_copy_of_an_eager_device_pass_rolls_back(monkeypatch, device, when):
    """Device mode's eager passes of a prefill copy with the engine; when
    pass 1's copies fail (before any or after all landed), the pool is as pass 0 left it."""
    monkeypatch.setattr(device_prepare, "OVERLAP_MAX_IDS", 4)  # 8 ids: a prefill
    weights, provider = warm(device, "device")
    passes = provider.passes(torch.arange(E, device=device).reshape(4, 2))  # 8 experts, 4 slots: 2 passes
    next(passes)  # the 4 resident experts, nothing copied
    before = snapshot(provider)
    monkeypatch.setattr(device_prepare, "copy_with_engine", when(device_prepare.copy_with_engine, RuntimeError))
    with pytest.raises(RuntimeError, match="injected"):
        next(passes)  # pass 1: 4 misses, 4 evictions
    monkeypatch.undo()
    assert_unchanged(provider, before)
    assert_next_call_is_right(provider, weights, device)


def fail_on_call(real, failure, number):
    """``real``, except that its ``number``-th call (from 1) does its work and then raises."""
    calls = []

    def wrapper(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(None)
        if len(calls) == number:
            raise failure("injected")

    return wrapper


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("step", ["admit", "copy_with_kernel"])
@pytest.mark.parametrize("failing_pass", [1, 2, 3])
def test_a_failing_overlapped_pass_leaves_the_passes_before_it(monkeypatch, device, step, failing_pass):
    """Overlapped passes admit pass g + 1 before yielding pass g. When a later pass fails,
    it is undone: the pool holds what the passes before it left (their experts in their
    slots, byte for byte), the error reaches the caller, and the next call is right."""
    weights, provider = warm(device, "device")
    ids = torch.arange(E, device=device).reshape(4, 2)  # 8 experts, 4 slots: 4 overlapped passes of 2
    monkeypatch.setattr(device_overlap, step, fail_on_call(getattr(device_overlap, step), RuntimeError,
                                                           failing_pass + 1))  # fmt: skip
    taken = 0
    with pytest.raises(RuntimeError, match="injected"):
        for _ in provider.passes(ids, overlap=True):
            taken += 1
    monkeypatch.undo()
    # passes 0 and 1 are enqueued before pass 0's hits are yielded, pass g + 1 before pass g
    assert taken == (0 if failing_pass == 1 else failing_pass)  # pass 0 comes as hits, then misses
    stats = provider.stats
    assert stats.hits + stats.misses - 6 == 2 * failing_pass  # the warm-up looked up 6 keys; then 2 a pass done
    for expert in provider.resident():  # no torn slot: what the tables say is what the slots hold
        for name, tensor in provider.pool.tensors.items():
            assert torch.equal(tensor[provider.slot_of(expert)].cpu(), provider.store.tensors[name][expert])
    assert_next_call_is_right(provider, weights, device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("taken", [1, 2, 3])
def test_an_overlapped_call_stopped_early_leaves_a_sound_pool(device, taken):
    """The caller takes ``taken`` results of an overlapped call (pass 0's hits, its misses,
    pass 1) and closes the generator, with later passes admitted and copying: the copy
    stream is joined, every resident expert's slot holds its bytes, a prefetch is allowed
    again and the next call is right."""
    weights, provider = warm(device, "device")
    ids = torch.arange(E, device=device).reshape(4, 2)  # 8 experts, 4 slots: 4 overlapped passes of 2
    passes = provider.passes(ids, overlap=True)
    for _ in range(taken):
        next(passes)
    passes.close()
    assert not provider.pool.copies_pending  # joined at close(), not when the generators are collected
    assert not provider.pool.passes_owed  # the inner generator's cleanup ran (the CPU has no copy stream to check)
    for expert in provider.resident():
        for name, tensor in provider.pool.tensors.items():
            assert torch.equal(tensor[provider.slot_of(expert)].cpu(), provider.store.tensors[name][expert])
    provider.prefetch(torch.tensor([6, 7], device=device))
    assert {6, 7} <= provider.resident()
    assert_next_call_is_right(provider, weights, device)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_ctrl_c_during_the_copies_waits_for_the_commit():
    """A real SIGINT during the copies is held until the call has committed, then raised.

    Python's own Ctrl-C handler is installed for the test: what the test runner's process
    had (a CI run once failed with no KeyboardInterrupt, unexplained) must not decide it."""
    weights, provider = warm("cpu", "host")
    real = provider.pool.copy_expert
    handlers = []  # the SIGINT handler in force at each press: the call's, not Python's

    def copy_and_press_ctrl_c(pairs):
        real(pairs)
        handlers.append(signal.getsignal(signal.SIGINT))
        signal.raise_signal(signal.SIGINT)

    provider.pool.copy_expert = copy_and_press_ctrl_c
    calls = provider.stats.calls
    runners = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            provider.prepare(torch.tensor([[5, 6]]))
    finally:
        signal.signal(signal.SIGINT, runners)
    assert len(handlers) == 2 and signal.default_int_handler not in handlers, (runners, handlers)
    provider.pool.copy_expert = real
    assert provider.stats.calls == calls + 1 and {5, 6} <= provider.resident()  # it completed
    assert_next_call_is_right(provider, weights, "cpu")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])
def test_built_in_inference_mode_serves_outside_it(device, mode):
    with torch.inference_mode():
        weights, provider = warm(device, mode)
    assert_next_call_is_right(provider, weights, device)
    with torch.inference_mode():
        assert_next_call_is_right(provider, weights, device)
