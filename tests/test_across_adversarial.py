"""`DecodeStack` steps that prefetch (across steps, and within one) after a step that failed
between a call's passes.

Found by an adversarial pass: a step whose ``apply`` raised after taking the first pass of an
overlapped device-mode call (a kernel launch failing, an allocation running out) left that
call's generator open, its misses' slots still promised (`SlotPool.passes`). The step's frame,
and with it the generator, lives as long as the exception does (``except ... as error`` kept,
a notebook's last traceback, ``pytest.raises``), and until then every step that prefetched
into that layer was refused before running ("an overlapped call of this pool has yet to
yield a pass"). The stack now ends a call with its apply, whatever the apply did.
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import cached_and_full_stacks

LAYERS, FAILING = 4, 2


def across_oracle(now: torch.Tensor, after: torch.Tensor, lookahead: int) -> torch.Tensor:
    """Rows ``0 .. d-1`` the next step's ids, the rest this step's (`DecodeStack`'s ``across_steps``)."""
    return torch.cat([after[:lookahead], now[lookahead:]])


def first_pass_then_fails(apply, failing_call: int):
    """``apply``, but its ``failing_call``-th call takes the first pass and then raises."""
    calls = []

    def run(hidden, results, weights):
        calls.append(None)
        if len(calls) != failing_call:
            return apply(hidden, results, weights)
        next(iter(results))  # the hits pass of an overlapped call: its misses are promised
        raise RuntimeError("injected: the apply failed between the passes")

    return run


@pytest.mark.parametrize("across_steps", [True, False])
@pytest.mark.parametrize("device", devices())
def test_a_step_failing_between_a_calls_passes_leaves_the_stack_prefetching(device, across_steps):
    gen = torch.Generator().manual_seed(11)
    cached, (stack, full), routing = cached_and_full_stacks(
        gen, tokens=1, cache_size=4, device=device, layers=LAYERS, lookahead=1, across_steps=across_steps
    )  # 4 slots of 16 experts: every call overlapped, its first pass split into hits and misses
    hidden = torch.randn(1, 64, generator=gen).to(device, torch.bfloat16)
    steps = [routing() for _ in range(5)]

    def guesses(index: int) -> torch.Tensor:
        return across_oracle(steps[index], steps[index + 1], 1) if across_steps else steps[index]

    assert torch.equal(stack.step(hidden, steps[0], guesses(0)), full.step(hidden, steps[0]))
    apply = stack.apply
    stack.apply = first_pass_then_fails(apply, FAILING + 1)
    with pytest.raises(RuntimeError, match="injected") as failure:  # held, as a caller may hold it
        stack.step(hidden, steps[1], guesses(1))
    stack.apply = apply
    calls = [p.stats.calls for p in cached]
    assert calls == [2, 2, 2, 1]  # the failing layer's call ran; the layer after it did not
    for index in range(2, 4):
        assert torch.equal(stack.step(hidden, steps[index], guesses(index)), full.step(hidden, steps[index]))
    assert [p.stats.calls - before for p, before in zip(cached, calls, strict=True)] == [2] * LAYERS
    assert failure.value is not None  # alive until here


@pytest.mark.parametrize("device", devices())
def test_timed_caches_prefetch_across_steps_and_finish_their_prefetches(device):
    """`TimedProvider` hands ``finish_prefetch`` on with ``prefetch``: a graphed step of timed
    caches across steps joins their copies (it had no such attribute: a capture raised)."""
    from expertcache.decode_stack import DecodeStack
    from expertcache.metrics import TimedProvider

    gen = torch.Generator().manual_seed(12)
    cached, (_, full), routing = cached_and_full_stacks(gen, tokens=1, cache_size=8, device=device, layers=3)
    timed = [TimedProvider(p) for p in cached]
    stack = DecodeStack(timed, 64, 16, dtype=torch.bfloat16, device=device, lookahead=1, across_steps=True)
    steps = [routing() for _ in range(3)]
    hidden = torch.randn(1, 64, generator=gen).to(device, torch.bfloat16)
    for index in range(2):
        served = stack.step(hidden, steps[index], across_oracle(steps[index], steps[index + 1], 1))
        assert torch.equal(served, full.step(hidden, steps[index]))
    for provider in timed:
        provider.finish_prefetch()  # joins (a no-op where nothing runs)
    assert [p.prefetch_stats.calls for p in timed] == [2, 2, 2]


@pytest.mark.gpu
def test_a_replay_after_an_eager_step_across_steps_waits_for_its_prefetches_and_checks_dtypes():
    from expertcache.decode_stack import GraphedDecodeStep

    gen = torch.Generator().manual_seed(13)
    cached, (stack, full), routing = cached_and_full_stacks(gen, tokens=2, cache_size=8, layers=4, lookahead=2,
                                                            across_steps=True)  # fmt: skip
    steps = [routing() for _ in range(6)]
    hidden = torch.randn(2, 64, generator=gen).to("cuda", torch.bfloat16)
    graph = GraphedDecodeStep(stack, hidden, steps[0].unsqueeze(0), across_oracle(steps[0], steps[1], 2).unsqueeze(0))
    for index in range(1, 5):  # eager and replayed steps alternate: an eager step leaves copies running
        guesses = across_oracle(steps[index], steps[index + 1], 2)
        served = stack.step(hidden, steps[index], guesses) if index % 2 else graph(hidden, steps[index], guesses)
        assert torch.equal(served, full.step(hidden, steps[index]))
    with pytest.raises(TypeError, match="routing is torch.float32; the graph was captured with torch.int64"):
        graph(hidden, steps[5].float(), across_oracle(steps[5], steps[5], 2))
    with pytest.raises(TypeError, match="hidden is torch.float32"):
        graph(hidden.float(), steps[5], across_oracle(steps[5], steps[5], 2))
