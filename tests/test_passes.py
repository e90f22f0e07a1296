"""Expert-group passes: calls with more distinct experts than slots, in every mode.

* `group_passes` (the one grouping) has the stated properties, and the device kernel that
  assigns passes equals its torch reference;
* over-capacity calls (T up to 4096, slots down to top-k, pools shared by layers, EP maps)
  equal the full-weights reference exactly, in host and device mode, and each expert is
  loaded at most once per call;
* overlapped passes (``overlap=True``) take half the share and never overwrite a slot the
  pass before reads (LRU); a decode stack overlaps decode-sized calls only;
* ``moe_apply_passes`` over the passes is bit-identical to `moe_apply` on all experts;
* a CUDA graph of a step whose calls need several passes replays with changing routing
  and equals eager (GPU).
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import cached_and_full_stacks, random_topk, random_weights, same_bytes, slot_bytes, views
from hypothesis import given, settings
from hypothesis import strategies as st

import expertcache.device_prepare as device_prepare
import expertcache.host_prepare as host_prepare
from expertcache import CachedWeightProvider, FullGPUProvider, SlotPool
from expertcache.kernels import moe_apply, moe_apply_grouped, moe_apply_passes
from expertcache.kernels.passes import assign_passes, assign_passes_torch
from expertcache.kernels.slot_tables import SlotTables
from expertcache.passes import group_passes, group_size, max_passes, pass_count
from expertcache.reference import combine_expert_outputs, expert_outputs, moe_forward

HIDDEN, INTER = 8, 4


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.integers(0, 40), unique=True, max_size=30),
    flags=st.lists(st.booleans(), min_size=30, max_size=30),
    num_slots=st.integers(1, 12),
    overlap=st.booleans(),
)
def test_groups_partition_the_call_resident_keys_first(keys, flags, num_slots, overlap):
    """Resident keys first, then the misses, cut into groups of ``G`` (a shared pool's layer
    may hold more resident keys than its share); each group in first-appearance order. A
    call that fits is one group; overlapped passes of one that does not take half the share."""
    resident = flags[: len(keys)]
    groups = group_passes(keys, resident, num_slots, overlap=overlap)
    size = group_size(len(keys), num_slots, overlap=overlap)
    fits = len(keys) <= num_slots
    assert size == (num_slots // 2 if overlap and not fits and num_slots >= 2 else num_slots)
    assert len(groups) == (1 if fits else pass_count(len(keys), size))
    hits = [key for key, flag in zip(keys, resident, strict=True) if flag]
    misses = [key for key, flag in zip(keys, resident, strict=True) if not flag]
    ranked = hits + misses
    assert [set(group) for group in groups] == [
        set(ranked[start : start + size]) for start in range(0, max(1, len(ranked)), size)
    ]
    order = {key: index for index, key in enumerate(keys)}
    assert all(list(group) == sorted(group, key=order.get) for group in groups)
    assert len(groups) <= max_passes(len(keys), 41, num_slots, overlap=overlap)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("tokens", "with_map"), [(3, False), (40, True), (300, False)])
def test_assign_passes_kernel_equals_reference(device, tokens, with_map, overlap):
    gen = torch.Generator().manual_seed(tokens)
    num_slots, num_keys, offset = 5, 30, 6
    tables = SlotTables.allocate(num_keys, num_slots, 2, torch.device(device))
    resident = torch.randperm(16, generator=gen)[:num_slots]
    tables.expert_to_slot[offset + resident] = torch.arange(num_slots, dtype=torch.int32, device=device)
    ids = torch.randint(-2, 20, (tokens, 4), generator=gen)
    ids[0, 0] = 2**32 + 3  # out of range in its own dtype
    mapping = None
    if with_map:
        mapping = torch.where(torch.arange(20) % 3 == 0, -1, torch.arange(20) // 2).to(torch.int32).to(device)
    ours, theirs = (torch.empty(ids.shape, dtype=torch.int32, device=device) for _ in range(2))
    before = tables.buffer.clone()
    kwargs = dict(num_global=20, key_offset=offset, overlap=overlap)
    assign_passes(tables, ids.to(device), mapping, ours, **kwargs)
    assert torch.equal(tables.buffer, before)  # reads the tables, leaves its scratch empty
    assign_passes_torch(tables, ids.to(device), mapping, theirs, **kwargs)
    assert torch.equal(ours, theirs)


def _reference_over_passes(hidden, results, weights) -> torch.Tensor:
    """`moe_forward` computed per pass: each (token, choice) from its pass, summed in k order.

    Each result is used before the next is taken (the next pass may overwrite its slots),
    and every (token, choice) must be served by exactly one pass.
    """
    per_choice, served = None, None
    for result in results:
        mine = (result.topk_ids >= 0).unsqueeze(-1)
        part = expert_outputs(hidden, result.w1, result.w2, result.topk_ids)
        assert served is None or not (served & mine).any()
        per_choice = part if per_choice is None else torch.where(mine, part, per_choice)
        served = mine if served is None else served | mine
    assert served is not None and bool(served.all())
    return combine_expert_outputs(per_choice, weights)


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize(("tokens", "top_k", "num_experts", "slots"), [(40, 2, 8, 2), (64, 4, 16, 5), (4096, 8, 64, 8)])
def test_over_capacity_calls_equal_the_full_weights_reference(mode, tokens, top_k, num_experts, slots):
    if mode == "device" and tokens > 64 and not torch.cuda.is_available():
        tokens = 512  # the interpreted admission walks every id in Python-driven blocks
    gen = torch.Generator().manual_seed(tokens + slots)
    weights = random_weights(num_experts, HIDDEN, INTER, generator=gen)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    provider = CachedWeightProvider(weights, cache_size=slots, mode=mode, device=device)
    full = {name: tensor.to(device) for name, tensor in weights.items()}
    for _ in range(1 if tokens > 1000 else 3):  # the reference is slow at 4096 tokens on a CPU
        ids = random_topk(tokens, top_k, num_experts, generator=gen).to(device)
        hidden = torch.randn(tokens, HIDDEN, generator=gen).to(device)
        router = torch.rand(tokens, top_k, generator=gen).to(device)
        before = provider.stats
        out = _reference_over_passes(hidden, provider.passes(ids), router)
        assert torch.equal(out, moe_forward(hidden, full["w1"], full["w2"], router, ids))
        stats = provider.stats
        distinct = ids.unique().numel()
        assert stats.calls - before.calls == 1
        # every distinct expert is a hit (pass 0) or loaded exactly once
        assert (stats.hits - before.hits) + (stats.misses - before.misses) == distinct


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("compression", [None, "exponent"])
def test_eager_device_prefills_copy_with_the_engine(monkeypatch, device, compression):
    """Device mode's eager prefills (more than ``OVERLAP_MAX_IDS`` ids, here 8, that may need
    more experts than the share) read each pass's plan back and copy with the engine (the
    default mover; a coded store's names through the decoding kernel from the device plan);
    ``mover="kernel"`` keeps the copy kernel, and so does any smaller call. Both make the same
    decisions into the same slot bytes."""
    monkeypatch.setattr(device_prepare, "OVERLAP_MAX_IDS", 8)
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float32 if compression is None else torch.bfloat16
    weights = {name: tensor.to(dtype) for name, tensor in random_weights(16, HIDDEN, INTER, generator=gen).items()}
    full = {name: tensor.to(device) for name, tensor in weights.items()}
    providers = {
        mover: CachedWeightProvider(
            weights,
            pool=SlotPool.for_weights(weights, 3, device=device, mode="device", mover=mover),
            compression=compression,
        )  # fmt: skip
        for mover in ("engine", "kernel")
    }
    used: list[str] = []
    for name in ("copy_with_engine", "copy_with_kernel"):
        real = getattr(device_prepare, name)
        monkeypatch.setattr(device_prepare, name, lambda *a, real=real, name=name: used.append(name) or real(*a))
    for tokens in (1, 4, 12, 1, 20):  # 2 and 8 ids: no prefill; 24 and 40 ids are
        ids = random_topk(tokens, 2, 16, generator=gen).to(device)
        hidden = torch.randn(tokens, HIDDEN, generator=gen).to(device, dtype)
        router = torch.rand(tokens, 2, generator=gen).to(device, dtype)
        for mover, provider in providers.items():
            used.clear()
            out = _reference_over_passes(hidden, provider.passes(ids), router)
            assert torch.equal(out, moe_forward(hidden, full["w1"], full["w2"], router, ids))
            by_engine = mover == "engine" and tokens > 4
            assert set(used) == {"copy_with_engine" if by_engine else "copy_with_kernel"}
        engine, kernel = providers.values()
        assert views(engine) == views(kernel)
        assert same_bytes(slot_bytes(engine.pool), slot_bytes(kernel.pool))


@pytest.mark.parametrize("mode", ["host", "device"])
def test_shared_pool_and_expert_map_in_passes(mode):
    gen = torch.Generator().manual_seed(7)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_global, tokens, top_k = 12, 24, 3
    local_of = torch.where(torch.arange(num_global) % 2 == 0, torch.arange(num_global) // 2, -1)
    layers = [random_weights(6, HIDDEN, INTER, generator=gen) for _ in range(2)]
    pool = SlotPool.for_weights(layers[0], 2, device=device, mode=mode)  # 2 slots for 2 layers
    providers = [
        CachedWeightProvider(w, pool=pool, layer=index, expert_map=local_of.to(torch.int32))
        for index, w in enumerate(layers)
    ]
    for _ in range(3):
        for provider, w in zip(providers, layers, strict=True):
            ids = random_topk(tokens, top_k, num_global, generator=gen)
            hidden = torch.randn(tokens, HIDDEN, generator=gen)
            local_ids = local_of[ids]  # -1: another rank's expert
            on = {name: tensor.to(device) for name, tensor in w.items()}  # the same matmuls as the slots'
            expected = expert_outputs(hidden.to(device), on["w1"], on["w2"], local_ids.to(device)).cpu()
            per_choice, served = torch.zeros_like(expected), torch.zeros(ids.shape, dtype=torch.bool)
            for result in provider.passes(ids.to(device)):  # each result consumed before the next
                mine = (result.topk_ids >= 0).cpu()
                assert not (served & mine).any()
                served |= mine
                part = expert_outputs(hidden.to(device), result.w1, result.w2, result.topk_ids).cpu()
                per_choice = torch.where(mine.unsqueeze(-1), part, per_choice)
            assert torch.equal(served, local_ids >= 0)  # other ranks' ids are -1 in every pass
            assert torch.equal(per_choice, expected)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("kernel", ["gemv", "grouped"])
def test_moe_apply_over_passes_is_bit_identical_to_one_call(device, mode, kernel):
    gen = torch.Generator().manual_seed(3)
    weights = random_weights(10, 32, 16, generator=gen)
    provider = CachedWeightProvider(weights, cache_size=3, mode=mode, device=device)
    full = {name: tensor.to(device) for name, tensor in weights.items()}
    one_call = moe_apply if kernel == "gemv" else moe_apply_grouped
    for _ in range(3):
        ids = random_topk(9, 3, 10, generator=gen).to(device)
        hidden = torch.randn(9, 32, generator=gen).to(device)
        router = torch.rand(9, 3, generator=gen).to(device)
        ours = moe_apply_passes(hidden, provider.passes(ids), router, kernel=kernel)
        assert torch.equal(ours, one_call(hidden, full["w1"], full["w2"], router, ids))


def test_device_mode_yields_the_most_passes_the_shape_allows():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights = random_weights(12, HIDDEN, INTER)
    provider = CachedWeightProvider(weights, cache_size=4, mode="device", device=device)
    ids = torch.tensor([[0, 1], [0, 1], [0, 1], [2, 3]], device=device)  # 4 experts: one pass needed
    results = list(provider.passes(ids))
    assert len(results) == max_passes(8, 12, 4) == 2
    assert torch.equal(results[1].topk_ids, torch.full_like(ids, -1))  # the spare pass is empty
    assert provider.stats.calls == 1 and provider.stats.misses == 4
    small = torch.tensor([[5, 6]], device=device)
    assert len(list(provider.passes(small))) == 1  # T*K <= S: always one pass


def test_bad_ids_raise_before_any_pass_runs():
    provider = CachedWeightProvider(random_weights(8, HIDDEN, INTER), cache_size=2, device="cpu")
    with pytest.raises(IndexError):
        next(provider.passes(torch.tensor([[0, 9], [1, 2]])))  # range: checked by pass 0's read
    with pytest.raises(TypeError):
        provider.passes(torch.tensor([[0.0, 1.0]]))  # metadata: checked before passes() returns
    assert provider.stats.calls == 0 and provider.resident() == frozenset()
    assert len(list(provider.passes(torch.tensor([[0, 1], [2, 3], [4, 5]])))) == 3


@pytest.mark.parametrize("device", devices())
def test_keys_found_on_the_device_equal_the_host_ones(device):
    """Large host-mode calls deduplicate on the device (`first_positions`): the same keys,
    in the same first-appearance order, as the host's `local_keys`, with an EP map and a
    shared pool's key offsets; an id out of range raises the same IndexError."""
    gen = torch.Generator().manual_seed(13)
    num_global = 24
    local_of = torch.where(torch.arange(num_global) % 3 != 1, torch.arange(num_global) * 2 // 3, -1).to(torch.int32)
    layers = [random_weights(16, HIDDEN, INTER, generator=gen) for _ in range(2)]
    pool = SlotPool.for_weights(layers[0], 4, device=device, mode="host")
    providers = [CachedWeightProvider(w, pool=pool, layer=index, expert_map=local_of) for index, w in enumerate(layers)]
    for trial in range(12):
        layer = providers[trial % 2].layer
        tokens = int(torch.randint(1, 300, (1,), generator=gen))
        ids = torch.randint(0, 1 + trial * 2, (tokens, 3), generator=gen)  # few distinct ids early on
        summary = host_prepare.first_positions(ids.reshape(-1).to(device), num_global).cpu().numpy()
        found = host_prepare.keys_from_first_positions(layer, summary, ids.numel())
        assert found == host_prepare.local_keys(layer, ids.numpy())
    for bad in (-1, num_global):
        ids = torch.zeros(host_prepare.DEVICE_KEYS_MIN_IDS, 1, dtype=torch.int64)
        ids[7, 0] = bad
        with pytest.raises(IndexError, match=f"expert id {bad} in topk_ids is outside"):
            next(providers[0].passes(ids.to(device)))
    assert providers[0].stats.calls == 0 and providers[0].resident() == frozenset()


@pytest.mark.parametrize("device", devices())
def test_host_passes_read_the_state_once_per_call(monkeypatch, device):
    """Pass 0 reads ids and state (the sync); later passes plan on what the passes before
    them committed, which must be what the device tables say."""
    gen = torch.Generator().manual_seed(5)
    weights = random_weights(16, HIDDEN, INTER, generator=gen)
    provider = CachedWeightProvider(weights, cache_size=3, mode="host", device=device)
    full = {name: tensor.to(device) for name, tensor in weights.items()}
    reads = []
    real_read = host_prepare._read
    monkeypatch.setattr(host_prepare, "_read", lambda *args: reads.append(args[1] is None) or real_read(*args))
    for _ in range(4):
        ids = random_topk(12, 2, 16, generator=gen).to(device)
        hidden, router = torch.randn(12, HIDDEN, generator=gen).to(device), torch.rand(12, 2, generator=gen).to(device)
        reads.clear()
        out = _reference_over_passes(hidden, provider.passes(ids), router)
        assert reads == [False]  # one read, of ids and state, for every pass
        assert torch.equal(out, moe_forward(hidden, full["w1"], full["w2"], router, ids))
    table = provider.pool.tables.expert_to_slot.cpu()
    slot_to_key = provider.pool.tables.slot_to_key.cpu()
    assert torch.equal(table[slot_to_key.long()], torch.arange(3, dtype=torch.int32))  # consistent tables


@pytest.mark.parametrize("device", devices())
def test_a_call_between_two_host_passes_makes_the_next_pass_read_again(monkeypatch, device):
    """Layer 1's call between layer 0's passes moves the shared pool's slots: layer 0's next
    pass must plan on the state read after it, and neither layer's experts get corrupted."""
    gen = torch.Generator().manual_seed(9)
    layers = [random_weights(8, HIDDEN, INTER, generator=gen) for _ in range(2)]
    pool = SlotPool.for_weights(layers[0], 6, device=device, mode="host")  # a share of 3 slots a layer
    providers = [CachedWeightProvider(w, pool=pool, layer=index) for index, w in enumerate(layers)]
    full = [{name: tensor.to(device) for name, tensor in w.items()} for w in layers]
    reads = []
    real_read = host_prepare._read
    monkeypatch.setattr(host_prepare, "_read", lambda *args: reads.append(args[1] is None) or real_read(*args))
    hidden, router = torch.randn(4, HIDDEN, generator=gen).to(device), torch.rand(4, 2, generator=gen).to(device)
    for round_ in range(3):
        big = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], device=device)  # 8 experts, 3 slots: 3 passes
        small = torch.tensor([[(round_ + 1) % 8, (round_ + 4) % 8]], device=device)
        reads.clear()
        per_choice, served = (
            torch.zeros(4, 2, HIDDEN, device=device),
            torch.zeros(4, 2, 1, dtype=torch.bool, device=device),
        )
        for index, result in enumerate(providers[0].passes(big)):
            mine = (result.topk_ids >= 0).unsqueeze(-1)
            per_choice = torch.where(mine, expert_outputs(hidden, result.w1, result.w2, result.topk_ids), per_choice)
            served |= mine
            if index == 0:  # another layer's call, between the passes
                other = providers[1].prepare(small)
                assert torch.equal(
                    expert_outputs(hidden[:1], other.w1, other.w2, other.topk_ids),
                    expert_outputs(hidden[:1], full[1]["w1"], full[1]["w2"], small),
                )
        assert bool(served.all())
        assert torch.equal(
            combine_expert_outputs(per_choice, router), moe_forward(hidden, full[0]["w1"], full[0]["w2"], router, big)
        )
        assert reads == [False, False, True]  # layer 0's call, layer 1's, layer 0's re-read
        again = providers[1].prepare(small)  # layer 1's experts were not overwritten behind its back
        assert torch.equal(
            expert_outputs(hidden[:1], again.w1, again.w2, again.topk_ids),
            expert_outputs(hidden[:1], full[1]["w1"], full[1]["w2"], small),
        )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("between", ["prepare", "overlapped passes"])
def test_a_call_between_two_overlapped_device_passes_stops_the_call(device, between):
    """Device mode admits an overlapped call's next pass ahead, so another layer's call in
    between may take its slots (a result would then point at other experts): layer 0's call
    raises instead, and both layers' next calls are right."""
    gen = torch.Generator().manual_seed(9)
    layers = [random_weights(8, HIDDEN, INTER, generator=gen) for _ in range(2)]
    pool = SlotPool.for_weights(layers[0], 8, device=device, mode="device")  # a share of 4 slots a layer
    providers = [CachedWeightProvider(w, pool=pool, layer=index) for index, w in enumerate(layers)]
    full = [{name: tensor.to(device) for name, tensor in w.items()} for w in layers]
    hidden = torch.randn(4, HIDDEN, generator=gen).to(device)
    big = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], device=device)  # 8 experts, groups of 2
    small = torch.tensor([[0, 1], [2, 3]], device=device)
    passes = providers[0].passes(big, overlap=True)
    next(passes)
    if between == "prepare":
        providers[1].prepare(small)
    else:
        for _ in providers[1].passes(small, overlap=True):
            pass
    with pytest.raises(RuntimeError, match="another call on this slot pool ran between the passes"):
        next(passes)
    assert not pool.copies_pending and not pool.passes_owed
    for provider, weights, ids in ((providers[0], full[0], big), (providers[1], full[1], small)):
        rows, served = hidden[: len(ids)], torch.zeros(*ids.shape, HIDDEN, device=device)
        for result in provider.passes(ids, overlap=True):
            mine = (result.topk_ids >= 0).unsqueeze(-1)
            served = torch.where(mine, expert_outputs(rows, result.w1, result.w2, result.topk_ids), served)
        assert torch.equal(served, expert_outputs(rows, weights["w1"], weights["w2"], ids))


@pytest.mark.gpu
def test_the_copy_stream_runs_above_the_compute_stream():
    """A device pool's copy stream (admissions and copies, a layer's critical path) has a
    higher CUDA priority (a lower number) than the default stream the apply runs on."""
    pool = SlotPool.for_weights(random_weights(4, HIDDEN, INTER), 2, device="cuda", mode="device")
    stream = pool.copy_stream()
    assert stream is not None and stream.priority < torch.cuda.current_stream().priority


@pytest.mark.gpu
def test_graphed_step_with_passes_replays_and_equals_eager():
    from expertcache.decode_stack import GraphedDecodeStep

    gen = torch.Generator().manual_seed(11)
    tokens, hidden_size = 8, 64
    cached, stacks, routing = cached_and_full_stacks(gen, tokens=tokens, cache_size=6)

    hidden = torch.randn(tokens, hidden_size, generator=gen).to("cuda", torch.bfloat16)
    graph = GraphedDecodeStep(stacks[0], hidden, routing().unsqueeze(0))
    for _ in range(4):
        step_routing = routing()  # 32 ids over 16 experts with 6 slots: 3 passes per layer
        replayed = graph(hidden, step_routing).clone()
        assert torch.equal(replayed, stacks[1].step(hidden, step_routing))
    assert all(p.stats.overflows == 0 for p in cached)


@pytest.mark.parametrize("device", devices())
def test_overlapped_decode_calls_serve_hits_then_misses(device):
    """``passes(ids, overlap=True)`` on a device-mode pool smaller than the layer: the hits,
    then the misses (each position in exactly one, with the slot of the unsplit call), same
    decisions and stats, and `moe_apply_passes` over the two is bit-identical to one call."""
    gen = torch.Generator().manual_seed(5)
    weights = random_weights(12, 32, 16, generator=gen)
    split, applied, plain = (CachedWeightProvider(weights, cache_size=6, mode="device", device=device) for _ in "abc")
    full = {name: tensor.to(device) for name, tensor in weights.items()}
    for step in range(10):
        ids = random_topk(1 + step % 2, 3, 12, generator=gen).to(device)
        before = split.resident()
        results = list(split.passes(ids, overlap=True))
        (one,) = plain.passes(ids)
        assert len(results) == 2
        hits, misses = results[0].topk_ids, results[1].topk_ids
        assert not ((hits >= 0) & (misses >= 0)).any()
        assert torch.equal(torch.where(hits >= 0, hits, misses), one.topk_ids)
        missed = {int(e) for e, m in zip(ids.reshape(-1).tolist(), misses.reshape(-1).tolist(), strict=True) if m >= 0}
        assert missed == set(ids.reshape(-1).tolist()) - before
        hidden, router = torch.randn(ids.shape[0], 32, generator=gen).to(device), torch.rand(ids.shape, generator=gen)
        ours = moe_apply_passes(hidden, applied.passes(ids, overlap=True), router.to(device))
        assert torch.equal(ours, moe_apply(hidden, full["w1"], full["w2"], router.to(device), ids))
    assert split.stats == applied.stats == plain.stats
    assert split.stats.misses > 5  # misses were served through the second pass


def _taken_while_the_next_is_copied(results, pool, layer, ids):
    """Each pass's result, once the next pass has been admitted (device mode admits it
    before yielding this one; host mode plans it when asked): checks that the slots the
    result reads still hold its experts then, for LRU, where overlapped passes promise it."""
    keys = [layer.key_offset + int(expert) for expert in ids.reshape(-1).tolist()]
    for result in results:
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)  # the next pass's admission runs on the copy stream
        slot_to_key = pool.tables.slot_to_key.cpu().tolist()
        for key, slot in zip(keys, result.topk_ids.reshape(-1).tolist(), strict=True):
            assert slot < 0 or slot_to_key[slot] == key
        yield result


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("shared", [False, True], ids=["own pool", "shared pool"])
def test_overlapped_passes_take_half_the_share_and_keep_the_pass_before(mode, shared):
    """``passes(ids, overlap=True)`` of calls that do not fit: groups of half the share, so
    the next pass's copies never land in a slot the pass before reads (LRU); the output
    equals the full-weights reference and every expert is loaded at most once."""
    gen = torch.Generator().manual_seed(21)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_experts, tokens, top_k, share = 16, 10, 3, 6
    layers = [random_weights(num_experts, HIDDEN, INTER, generator=gen) for _ in range(2 if shared else 1)]
    pool = SlotPool.for_weights(layers[0], share * len(layers), device=device, mode=mode)
    providers = [CachedWeightProvider(w, pool=pool, layer=index) for index, w in enumerate(layers)]
    full = [{name: tensor.to(device) for name, tensor in w.items()} for w in layers]
    split_calls = 0
    for _ in range(4):
        for provider, weights in zip(providers, full, strict=True):
            ids = random_topk(tokens, top_k, num_experts, generator=gen).to(device)
            hidden = torch.randn(tokens, HIDDEN, generator=gen).to(device)
            router = torch.rand(tokens, top_k, generator=gen).to(device)
            before = provider.stats
            results = []  # each result is computed as it comes: the next pass may overwrite its slots
            taken = _taken_while_the_next_is_copied(provider.passes(ids, overlap=True), pool, provider.layer, ids)
            out = _reference_over_passes(hidden, (results.append(r) or r for r in taken), router)
            assert torch.equal(out, moe_forward(hidden, weights["w1"], weights["w2"], router, ids))
            distinct = ids.unique().numel()
            groups = 1 if distinct <= share else -(-distinct // (share // 2))
            most = max_passes(ids.numel(), num_experts, share, overlap=True)
            served = groups + (mode == "device")  # device mode serves pass 0 as its hits, then its misses
            assert len(results) == (groups if mode == "host" else most + 1)
            assert all(bool((r.topk_ids < 0).all()) for r in results[served:])  # the spare passes are empty
            assert all(len(set(r.topk_ids[r.topk_ids >= 0].tolist())) <= share // 2 for r in results[:served])
            stats = provider.stats
            assert (stats.hits - before.hits) + (stats.misses - before.misses) == distinct  # each loaded once
            split_calls += distinct > share
    assert split_calls >= 3 * len(providers)  # the calls did not fit: passes were taken


@pytest.mark.parametrize("device", devices())
def test_overlap_keeps_one_pass_where_nothing_can_be_missed(device):
    """A pool holding the whole layer, host mode and a full provider serve as usual."""
    weights = random_weights(6, HIDDEN, INTER)
    ids = torch.tensor([[0, 1]], device=device)
    whole = CachedWeightProvider(weights, cache_size=6, mode="device", device=device)
    host = CachedWeightProvider(weights, cache_size=3, mode="host", device=device)
    full = FullGPUProvider({name: tensor.to(device) for name, tensor in weights.items()})
    for provider in (whole, host, full):
        (result,) = provider.passes(ids, overlap=True)
        assert (result.topk_ids >= 0).all()


@pytest.mark.parametrize("device", devices())
def test_decode_stack_overlaps_only_with_an_apply_that_sums_passes_exactly(device):
    from expertcache.decode_stack import DecodeStack
    from expertcache.provider import ExpertWeightProvider

    class OldSignature(ExpertWeightProvider):  # a provider written before ``overlap`` existed
        def __init__(self, weights):
            self.full = FullGPUProvider(weights)

        def prepare(self, topk_ids):
            return self.full.prepare(topk_ids)

        def passes(self, topk_ids):
            yield self.prepare(topk_ids)

    weights = {name: tensor.to(device) for name, tensor in random_weights(6, HIDDEN, INTER).items()}
    assert DecodeStack([], HIDDEN, 6, dtype=torch.float32, device=device).overlap

    def per_pass_sum(hidden, results, topk_weights):  # sums each pass's output: not exact
        return sum(moe_apply(hidden, r.w1, r.w2, topk_weights, r.topk_ids) for r in results)

    summed = DecodeStack([OldSignature(weights)], HIDDEN, 6, dtype=torch.float32, device=device, apply=per_pass_sum)
    assert not summed.overlap
    out = summed.step(torch.randn(1, HIDDEN, device=device), torch.tensor([[[0, 1]]], device=device))
    assert out.shape == (1, HIDDEN)


def test_decode_stack_overlaps_decode_sized_calls_only(monkeypatch):
    """A prefill-sized call (more than ``OVERLAP_MAX_IDS`` ids) takes passes one after the
    other, a decode-sized one overlapped passes; the output is the same either way."""
    from expertcache import decode_stack
    from expertcache.decode_stack import DecodeStack

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the apply's kernels run there
    weights = random_weights(6, HIDDEN, INTER)
    provider = CachedWeightProvider(weights, cache_size=2, mode="host", device=device)
    asked = []
    real = provider.passes
    monkeypatch.setattr(provider, "passes", lambda ids, **kwargs: asked.append(kwargs) or real(ids, **kwargs))
    monkeypatch.setattr(decode_stack, "OVERLAP_MAX_IDS", 8)
    stack = DecodeStack([provider], HIDDEN, 6, dtype=torch.float32, device=device)
    full = DecodeStack([FullGPUProvider({name: w.to(device) for name, w in weights.items()})], HIDDEN, 6,
                       dtype=torch.float32, device=device)  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    for tokens in (4, 5):  # 8 ids, then 10
        hidden = torch.randn(tokens, HIDDEN, generator=gen).to(device)
        routing = random_topk(tokens, 2, 6, generator=gen)[None].to(device)
        assert torch.equal(stack.step(hidden, routing), full.step(hidden, routing))
    assert asked == [{"overlap": True, "landing": True}, {}]


def test_the_simulator_replays_a_decode_stack_with_prefill_sized_calls(monkeypatch):
    """`DecodeStack` overlaps calls of at most ``OVERLAP_MAX_IDS`` ids only; ``replay(...,
    oversize="overlapped", overlap_max_ids=...)`` makes its decisions, where replaying every
    call as overlapped (or none) does not."""
    from expertcache import decode_stack
    from expertcache.decode_stack import DecodeStack
    from expertcache.sim import replay

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the apply's kernels run there
    monkeypatch.setattr(decode_stack, "OVERLAP_MAX_IDS", 8)
    weights = random_weights(8, HIDDEN, INTER)
    provider = CachedWeightProvider(weights, cache_size=4, mode="host", device=device)
    stack = DecodeStack([provider], HIDDEN, 8, dtype=torch.float32, device=device)
    gen = torch.Generator().manual_seed(4)
    calls = []
    for step in range(24):
        tokens = 2 + step % 5  # 4 to 12 ids: the larger ones are served without overlap
        routing = random_topk(tokens, 2, 8, generator=gen)[None]
        stack.step(torch.randn(tokens, HIDDEN, generator=gen).to(device), routing.to(device))
        calls.append(routing.reshape(-1).tolist())
    counts = (provider.stats.hits, provider.stats.misses, provider.stats.evictions)
    common = dict(policy="lru", capacity=4, oversize="overlapped")
    threshold = replay(calls, **common, overlap_max_ids=8)
    assert counts == (threshold.hits, threshold.misses, threshold.evictions)
    others = [replay(calls, **common), replay(calls, policy="lru", capacity=4)]
    assert all((r.hits, r.misses, r.evictions) != counts for r in others)  # the threshold decided something


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])
def test_overlap_must_be_a_bool_and_a_bad_one_changes_nothing(device, mode):
    weights = random_weights(6, HIDDEN, INTER)
    provider = CachedWeightProvider(weights, cache_size=3, mode=mode, device=device)
    full = FullGPUProvider({name: tensor.to(device) for name, tensor in weights.items()})
    ids = torch.tensor([[0, 1]], device=device)
    for bad in ("yes", 1, None):
        for served in (provider, full):
            with pytest.raises(TypeError, match="overlap"):
                served.passes(ids, overlap=bad)
        with pytest.raises(TypeError, match="overlap"):
            from expertcache.decode_stack import DecodeStack

            DecodeStack([provider], HIDDEN, 6, dtype=torch.float32, device=device, overlap=bad or "no")
    assert provider.stats.calls == 0 and provider.resident() == frozenset()
    assert len(list(provider.passes(ids, overlap=True))) in (1, 2)  # still serves
