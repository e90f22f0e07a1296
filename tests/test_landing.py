"""Landing counts (`expertcache.kernels.landing`): an overlapped device-mode call hands over
its copied passes once admitted, with per-slot counters its apply waits on.

Under the interpreter the copies have landed by the time the apply runs, so these tests
check the counters' values and that the waiting kernels compute what the others do. On a
GPU only a call captured in a CUDA graph takes counters (eager calls wait for whole copies,
as checked here); the graphed decode-step tests (tests/test_passes.py) replay landed steps
against eager ones.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from conftest import devices
from helpers import random_topk, random_weights

from expertcache import CachedWeightProvider, FullGPUProvider
from expertcache.decode_stack import DecodeStack
from expertcache.kernels import moe_apply, moe_apply_passes
from expertcache.kernels.admission import admit
from expertcache.kernels.copy_experts import CopyPlan, copy_experts
from expertcache.kernels.landing import DOWN_UNIT, Counting
from expertcache.kernels.quant_passes import moe_apply_quant_passes
from expertcache.kernels.slot_tables import SlotTables
from expertcache.mover import landing_counting
from expertcache.result import Landing

HIDDEN, INTER, EXPERTS = 32, 16, 12


def _providers(device, count=2, cache_size=4, dtype=torch.float32, seed=3):
    gen = torch.Generator().manual_seed(seed)
    weights = random_weights(EXPERTS, HIDDEN, INTER, dtype=dtype, generator=gen)
    cached = [CachedWeightProvider(weights, cache_size=cache_size, mode="device", device=device) for _ in range(count)]
    return cached, {name: tensor.to(device) for name, tensor in weights.items()}, gen


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kernel", ["gemv", "grouped"])
def test_landed_passes_carry_full_counters_and_compute_what_the_others_do(device, kernel):
    """Calls that fit and calls of several passes (4 slots, up to 9 experts): the hits come
    without counters; every later pass with counters that read ``target`` at each slot it
    serves (interpreted; an eager GPU call takes none); the decisions equal a provider's
    without landing, and `moe_apply_passes` over the landed passes equals it over the
    others, bit for bit, and the full weights' apply."""
    counted = device == "cpu"  # eager GPU calls wait for whole copies
    (landed, plain), full, gen = _providers(device)
    counting = landing_counting(landed.layer.copy_groups)
    assert counting is not None and counting.gate_up_mask == DOWN_UNIT - 1  # w1 counted apart from w2
    target = counting.target
    assert target > counting.gate_up_target >= 1
    several = 0
    for step in range(8):
        tokens = 1 + step % 3
        ids = random_topk(tokens, 3, EXPERTS, generator=gen).to(device)
        hidden = torch.randn(tokens, HIDDEN, generator=gen).to(device)
        router = torch.rand(ids.shape, generator=gen).to(device)
        seen: list[Landing | None] = []

        def checked(results, seen=seen):
            for result in results:
                seen.append(result.landing)
                if result.landing is not None:  # read while this pass is current: its slots are its own
                    assert result.landing.target == target
                    assert result.landing.gate_up() == (counting.gate_up_target, DOWN_UNIT - 1)
                    served = result.topk_ids[result.topk_ids >= 0].long()
                    assert bool((result.landing.counts[served] == target).all())
                yield result

        ours = moe_apply_passes(hidden, checked(landed.passes(ids, overlap=True, landing=True)), router, kernel=kernel)
        theirs = moe_apply_passes(hidden, plain.passes(ids, overlap=True), router, kernel=kernel)
        assert torch.equal(ours, theirs), step
        if kernel == "gemv":
            assert torch.equal(ours, moe_apply(hidden, full["w1"], full["w2"], router, ids)), step
        else:
            assert torch.allclose(ours, moe_apply(hidden, full["w1"], full["w2"], router, ids), atol=1e-5)
        assert seen[0] is None
        assert all(isinstance(counters, Landing) if counted else counters is None for counters in seen[1:])
        several += len(seen) > 2
    assert landed.stats == plain.stats
    assert landed.stats.misses > 5 and several > 0  # copies were counted, and calls took several passes


@pytest.mark.parametrize("device", devices())
def test_landing_is_a_permission_where_nothing_is_counted(device):
    """Host mode, a pool holding the whole layer and a resident provider take ``landing=True``
    and serve as without it: no result carries counters."""
    weights = random_weights(6, HIDDEN, INTER)
    ids = torch.tensor([[0, 1], [2, 5]], device=device)
    host = CachedWeightProvider(weights, cache_size=3, mode="host", device=device)
    whole = CachedWeightProvider(weights, cache_size=6, mode="device", device=device)
    full = FullGPUProvider({name: tensor.to(device) for name, tensor in weights.items()})
    for provider in (host, whole, full):
        results = list(provider.passes(ids, overlap=True, landing=True))
        assert results and all(result.landing is None for result in results)


@pytest.mark.parametrize("device", devices())
def test_a_decode_stack_lands_only_for_an_apply_that_waits(device):
    """`DecodeStack` asks for counters with `moe_apply_passes` (overlapped), never with
    another apply, and refuses ``landing`` without ``overlap``; the landed stack's steps
    equal the unlanded one's."""
    (landed_cache, plain_cache), full, gen = _providers(device, seed=8)
    landed = DecodeStack([landed_cache], HIDDEN, EXPERTS, dtype=torch.float32, device=device)
    plain = DecodeStack([plain_cache], HIDDEN, EXPERTS, dtype=torch.float32, device=device, landing=False)
    assert landed.landing and not plain.landing
    assert not DecodeStack([], HIDDEN, EXPERTS, dtype=torch.float32, device=device, overlap=False).landing
    quant = DecodeStack([], HIDDEN, EXPERTS, dtype=torch.float32, device=device, apply=moe_apply_quant_passes)
    assert quant.overlap and not quant.landing
    quant.apply = moe_apply_passes  # a stack whose apply is swapped asks as its new apply allows
    assert quant.landing
    landed_copy = DecodeStack([], HIDDEN, EXPERTS, dtype=torch.float32, device=device)
    landed_copy.apply = functools.partial(moe_apply_quant_passes, scheme=None)
    assert landed_copy.overlap and not landed_copy.landing
    with pytest.raises(ValueError, match="landing needs overlap"):
        DecodeStack([], HIDDEN, EXPERTS, dtype=torch.float32, device=device, overlap=False, landing=True)
    with pytest.raises(TypeError, match="landing must be True or False"):
        DecodeStack([], HIDDEN, EXPERTS, dtype=torch.float32, device=device, landing="yes")
    with pytest.raises(ValueError, match="moe_apply_quant_passes does not"):
        DecodeStack([], HIDDEN, EXPERTS, dtype=torch.float32, device=device, apply=moe_apply_quant_passes,
                    landing=True)  # fmt: skip
    for tokens in (1, 3, 2):
        hidden = torch.randn(tokens, HIDDEN, generator=gen).to(device)
        routing = random_topk(tokens, 3, EXPERTS, generator=gen)[None].to(device)
        assert torch.equal(landed.step(hidden, routing), plain.step(hidden, routing))
    assert landed_cache.stats == plain_cache.stats and landed_cache.stats.misses > 0


@pytest.mark.parametrize("device", devices())
def test_bad_landing_input_is_refused_and_changes_nothing(device):
    (provider, _), _, gen = _providers(device, seed=4)
    ids = random_topk(2, 3, EXPERTS, generator=gen).to(device)
    before = provider.pool.tables.buffer.clone()
    with pytest.raises(TypeError, match="landing must be True or False"):
        provider.passes(ids, overlap=True, landing=1)
    assert torch.equal(provider.pool.tables.buffer, before)
    hidden, router = torch.randn(2, HIDDEN, device=device), torch.rand(2, 3, device=device)
    (result,) = FullGPUProvider({name: t.to(device) for name, t in random_weights(4, HIDDEN, INTER).items()}).passes(
        torch.tensor([[0, 1, 2], [3, 0, 1]], device=device)
    )
    full = torch.full((4,), 9, dtype=torch.int32, device=device)
    for counts, target, gate_up, message in (
        (full.long(), 9, (None, -1), "int32 counter per slot"),
        (full[:2], 9, (None, -1), "int32 counter per slot"),
        (full, 0, (None, -1), "positive int"),
        (full, 9, (0, 15), "positive int"),
        (full, 9, (True, 15), "positive int"),
        (full, 9, (9, 2**40), "gate_up_mask must be an int32 bit mask"),
        (full, 9, (9, 15.0), "gate_up_mask must be an int32 bit mask"),
    ):
        bad = dataclasses.replace(result, landing=Landing(counts, target, *gate_up))
        with pytest.raises(ValueError, match=message):
            moe_apply_passes(hidden, [bad], router)
    landed = dataclasses.replace(result, landing=Landing(full, 9))
    assert torch.equal(moe_apply_passes(hidden, [landed], router), moe_apply_passes(hidden, [result], router))
    with pytest.raises(ValueError, match="does not wait on landing counters"):
        moe_apply_quant_passes(hidden, [landed], router, scheme=None)  # refused before the scheme is read
    tables = SlotTables.allocate(EXPERTS, 4, 1, torch.device(device))
    state = tables.buffer.clone()
    out = torch.empty_like(ids)
    for landed, target in ((torch.zeros(4, dtype=torch.int64, device=device), 3),
                           (torch.zeros(4, dtype=torch.int32, device=device), 0)):  # fmt: skip
        with pytest.raises(ValueError, match="landed"):
            admit(tables, ids, None, out, num_global=EXPERTS, key_offset=0, layer=0, landed=landed,
                  landed_target=target)  # fmt: skip
        assert torch.equal(tables.buffer, state)
    segments = provider.layer.copy_groups[0].segments
    slots = [torch.zeros(4, 8, device=device) for _ in segments.words]
    plan = CopyPlan.of(torch.zeros(17, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="landed must be an int32 counter per slot"):
        copy_experts(torch.zeros(64, dtype=torch.uint8), slots, plan, segments, unit=4, num_experts=2,
                     landed=torch.zeros(3, dtype=torch.int32, device=device))  # fmt: skip
    counters = torch.zeros(4, dtype=torch.int32, device=device)
    for counts in ((1,), (1, 0), (1, True), (1, 1.0), (1, 2**31)):
        with pytest.raises(ValueError, match="landed_counts"):
            copy_experts(torch.zeros(64, dtype=torch.uint8), slots, plan, segments, unit=4, num_experts=2,
                         landed=counters, landed_counts=counts)  # fmt: skip
    assert not counters.any()


def test_counting_keeps_gate_ups_names_apart_where_an_int32_holds_both():
    split = Counting.of({"w1": 3, "w2": 2})
    assert split == Counting({"w1": 1, "w2": DOWN_UNIT}, 3 + 2 * DOWN_UNIT, 3, DOWN_UNIT - 1)
    scaled = Counting.of({"w1": 4, "w2": 2, "w1_scale": 1, "w2_scale": 1})
    assert scaled.weights == {"w1": 1, "w2": DOWN_UNIT, "w1_scale": 1, "w2_scale": DOWN_UNIT}
    assert (scaled.target, scaled.gate_up_target) == (5 + 3 * DOWN_UNIT, 5)
    # not split: no w1, only w1, w1's chunks past the low bits, or w2's past an int32
    for chunks in ({"w2": 5}, {"w1": 5}, {"w1": DOWN_UNIT, "w2": 1}, {"w1": 1, "w2": 2**15}):
        whole = Counting.of(chunks)
        total = sum(chunks.values())
        assert whole == Counting(dict.fromkeys(chunks, 1), total, total, -1), chunks
    assert Counting.of({"w1": 1, "w2": 2**15 - 1}).gate_up_mask == DOWN_UNIT - 1  # the largest that fits


@pytest.mark.parametrize("device", devices())
def test_gate_up_counts_each_served_pairs_tiles_for_down(device):
    """A landed GEMV pass: gate_up counts its tiles into the pass's pairs only (a pair of
    another pass, -1 here, keeps its count), and its output rows equal the unlanded launch's."""
    from expertcache.kernels._launch import program_rows
    from expertcache.kernels.expert_apply import GATE_UP_TILE, launch_pairs

    gen = torch.Generator().manual_seed(6)
    weights = {name: t.to(device) for name, t in random_weights(5, HIDDEN, INTER, generator=gen).items()}
    ids = torch.tensor([[0, -1, 3], [4, 3, -1]], dtype=torch.int32, device=device)
    hidden, router = torch.randn(2, HIDDEN, generator=gen).to(device), torch.rand(2, 3, generator=gen).to(device)
    landing = Landing(torch.full((5,), 7, dtype=torch.int32, device=device), 7)  # every slot landed
    outputs = []
    for counted in (False, True):
        act = torch.zeros(6, INTER, device=device)
        part = torch.full((6, HIDDEN), 5.0, device=device)
        done = torch.tensor([0, 9, 0, 0, 0, 9], dtype=torch.int32, device=device) if counted else None
        launch_pairs(hidden, weights["w1"], weights["w2"], None, None, 128, ids, router, act, part, False,
                     landing if counted else None, done)  # fmt: skip
        outputs.append(part)
    tiles = -(-INTER // program_rows(GATE_UP_TILE[0], INTER))
    assert done.tolist() == [tiles, 9, tiles, tiles, tiles, 9]
    assert torch.equal(outputs[0], outputs[1]) and bool((outputs[1][[1, 5]] == 5.0).all())
    with pytest.raises(ValueError, match="counter of gate_up tiles per pair"):
        launch_pairs(hidden, weights["w1"], weights["w2"], None, None, 128, ids, router, act, part, False, landing,
                     done[:3])  # fmt: skip
