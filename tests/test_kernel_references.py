"""Every cache kernel equals its pure-torch reference: admission, commit, copy, apply.

Index tensors and tables compare exactly; poison (0xFF / -7) fills everything a kernel may
write, so an unwritten output cannot pass. Interpreted on a CPU, compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import random_topk, random_weights

from expertcache.kernels import moe_apply, moe_apply_torch
from expertcache.kernels._launch import walk_launch
from expertcache.kernels.admission import admit, admit_torch
from expertcache.kernels.commit import commit_plan, commit_plan_torch
from expertcache.kernels.copy_experts import (
    CopyPlan,
    build_segments,
    copy_experts,
    copy_experts_torch,
    segment_chunks,
)
from expertcache.kernels.passes import assign_passes, assign_passes_torch
from expertcache.kernels.slot_tables import SlotTables
from expertcache.layout import ExpertLayout, ExpertTensorSpec


def _same_tables(a: SlotTables, b: SlotTables) -> None:
    for name in ("expert_to_slot", "slot_to_key", "last_use", "clock", "counters", "first_seen"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    count = int(a.plan[0])
    assert count == int(b.plan[0])
    assert torch.equal(a.plan_entries()[:count], b.plan_entries()[:count])


def _call(gen: torch.Generator, num_global: int, num_slots: int) -> torch.Tensor:
    """One call: decode-sized, prefill-sized (> 64 ids), over-full, or with bad ids."""
    kind = int(torch.randint(0, 4, (1,), generator=gen))
    if kind == 0:
        return random_topk(2, min(4, num_global), num_global, generator=gen)
    if kind == 1:
        return torch.randint(0, num_global, (40, 2), generator=gen)  # 80 ids: the large kernel
    if kind == 2:
        return torch.randperm(num_global, generator=gen)[: num_slots + 1].reshape(1, -1)  # does not fit
    ids = random_topk(2, 3, num_global, generator=gen)
    ids[0, 0], ids[1, 2] = -4, 2**32 + 3  # out of range in the ids' own dtype: not expert 3
    return ids


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("with_map", [False, True], ids=["identity", "expert map"])
@pytest.mark.parametrize("num_slots", [3, 5])
@pytest.mark.parametrize("split", [False, True], ids=["one out", "hits and misses apart"])
@pytest.mark.parametrize("shares", [False, True], ids=["one LRU", "layer shares"])
def test_admission_equals_reference(device, with_map, num_slots, split, shares):
    """Two layers share the tables (key offsets 0 and 6); 40 random calls, state compared after
    each; ``split``: calls write hits and misses to two outputs; ``shares``: the layers keep
    their shares (calls above a share but within the slots take the fallback). Every fourth
    call is one pass of a random two-pass assignment."""
    gen = torch.Generator().manual_seed(num_slots + 10 * with_map)
    num_local, num_global = 6, 9
    mapping = torch.full((num_global,), -1, dtype=torch.int32)
    mapping[torch.randperm(num_global, generator=gen)[:num_local]] = torch.arange(num_local, dtype=torch.int32)
    kernel, reference = (SlotTables.allocate(2 * num_local, num_slots, 2, torch.device(device)) for _ in range(2))
    for step in range(40):
        layer = step % 2
        ids = _call(gen, num_global if with_map else num_local, num_slots)
        ids = ids.to(device, torch.int32 if step % 3 == 0 and ids.max() < 2**31 else torch.int64)
        g2l = mapping.to(device) if with_map else None
        outs = [torch.full_like(ids, -7) for _ in range(2)]
        kwargs = dict(num_global=num_global if with_map else num_local, key_offset=num_local * layer, layer=layer)
        misses = [torch.full_like(ids, -7) for _ in range(2)] if split else [None, None]
        if step % 4 == 1:
            kwargs["passes"] = torch.randint(0, 2, ids.shape, generator=gen, dtype=torch.int32).to(device)
            kwargs["pass_index"] = (step // 4) % 2
        if shares:
            kwargs["key_layer"] = torch.arange(2, dtype=torch.int32, device=device).repeat_interleave(num_local)
        landed = [torch.full((num_slots,), -5, dtype=torch.int32, device=device) for _ in range(2)]
        counted = step % 2 == 0  # every other call zeroes its landing counters and marks its hits
        if counted:
            kwargs["landed_target"] = 7
        admit(kernel, ids, g2l, outs[0], miss_out=misses[0], landed=landed[0] if counted else None, **kwargs)
        admit_torch(reference, ids, g2l, outs[1], miss_out=misses[1], landed=landed[1] if counted else None, **kwargs)
        assert torch.equal(outs[0], outs[1]), step
        if misses[0] is not None:
            assert torch.equal(misses[0], misses[1]), step
            assert not ((outs[0] >= 0) & (misses[0] >= 0)).any()
        assert torch.equal(landed[0], landed[1]), step
        if counted:  # the hits' slots read landed, every other slot waits for its copy
            hits = outs[0][(outs[0] >= 0) & ((misses[0] < 0) if misses[0] is not None else True)].unique()
            copied = kernel.plan_entries()[: int(kernel.plan[0]), 1].to(device).long()
            assert set(landed[0].nonzero().flatten().tolist()) <= set(hits.tolist())
            assert not bool(landed[0][copied].any())
        else:
            assert bool((landed[0] == -5).all())
        _same_tables(kernel, reference)
    assert int(kernel.counters[:, 5].sum()) > 0, "no call overflowed: the flag went untested"
    assert int(kernel.counters[:, 4].sum()) > 0, "no invalid id was counted"


@pytest.mark.parametrize("device", devices())
def test_an_overflowing_call_changes_nothing(device):
    """More distinct experts than slots, through the launcher: no write outside the plan."""
    tables = SlotTables.allocate(8, 2, 1, torch.device(device))
    out = torch.empty(1, 2, dtype=torch.int64, device=device)
    admit(tables, torch.tensor([[1, 5]], device=device), None, out, num_global=8, key_offset=0, layer=0)
    before = tables.buffer.clone()
    for ids in ([[0, 2, 3]], [list(range(8)) * 10]):  # the register kernel, then the large one
        ids = torch.tensor(ids, device=device)
        out = torch.empty_like(ids)
        admit(tables, ids, None, out, num_global=8, key_offset=0, layer=0)
        assert bool((out == -1).all())
        old = SlotTables.view(before, 8, 2, 1)
        for name in ("expert_to_slot", "slot_to_key", "last_use", "clock", "first_seen"):
            assert torch.equal(getattr(tables, name), getattr(old, name)), name
        assert torch.equal(tables.counters[0, :5], old.counters[0, :5])  # only the overflow counter moved
        assert int(tables.counters[0, 5]) == int(old.counters[0, 5]) + 1
        before = tables.buffer.clone()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("block_ids", [16, 64, 1024])
def test_the_one_program_walks_equal_the_reference_at_any_step(device, block_ids):
    """Pass assignment and the large admission kernel read a call ``block_ids`` ids a step: a
    call of 200 ids (13 steps of 16, 4 of 64, 1 of 1,024; 11 experts, 4 slots: 3 passes; the
    last pass's hits and misses apart) gives the reference's passes, slot ids and tables."""
    gen = torch.Generator().manual_seed(block_ids)
    num_experts, num_slots = 11, 4
    kernel, reference = (SlotTables.allocate(num_experts, num_slots, 1, torch.device(device)) for _ in range(2))
    ids = torch.randint(0, num_experts, (50, 4), generator=gen).to(device)
    where = dict(num_global=num_experts, key_offset=0)
    passes = [torch.full(ids.shape, -7, dtype=torch.int32, device=device) for _ in range(2)]
    assign_passes(kernel, ids, None, passes[0], block_ids=block_ids, **where)
    assign_passes_torch(reference, ids, None, passes[1], **where)
    assert torch.equal(passes[0], passes[1]) and int(passes[0].max()) == 2
    for index in range(3):
        split = index == 2
        outs = [torch.full_like(ids, -7) for _ in range(2)]
        misses = [torch.full_like(ids, -7) for _ in range(2)] if split else [None, None]
        landed = [torch.full((num_slots,), -5, dtype=torch.int32, device=device) for _ in range(2)]
        kwargs = dict(layer=0, passes=passes[0], pass_index=index, landed_target=3, **where)
        admit(kernel, ids, None, outs[0], miss_out=misses[0], block_ids=block_ids, landed=landed[0], **kwargs)
        admit_torch(reference, ids, None, outs[1], miss_out=misses[1], landed=landed[1], **kwargs)
        assert torch.equal(outs[0], outs[1]), index
        assert torch.equal(landed[0], landed[1]) and not bool((landed[0] == -5).any()), index
        if split:
            assert torch.equal(misses[0], misses[1])
        _same_tables(kernel, reference)


def test_walks_launch_as_measured():
    """Calls of at most 1,024 ids launch as before the 4,096-id steps (4 warps, 8 over more
    than 1,024 slots); larger ones read up to 4,096 ids a step at 8 a thread; given values win."""
    assert [walk_launch(n) for n in (1, 65, 1024, 1025, 2049, 40000)] == [
        (16, 4), (128, 4), (1024, 4), (2048, 8), (4096, 16), (4096, 16),
    ]  # fmt: skip
    assert walk_launch(1024, min_warps=8) == (1024, 8) and walk_launch(40000, min_warps=8) == (4096, 16)
    assert walk_launch(40000, block_ids=1024, num_warps=2) == (1024, 2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(block_ids=0), "block_ids must be a power of two from 16 to 65536"),
        (dict(block_ids=8), "block_ids must be a power of two from 16 to 65536"),
        (dict(block_ids=100), "block_ids must be a power of two from 16 to 65536"),
        (dict(block_ids=2**17), "block_ids must be a power of two from 16 to 65536"),
        (dict(num_warps=0), "num_warps must be a power of two from 1 to 32"),
        (dict(num_warps=3), "num_warps must be a power of two from 1 to 32"),
    ],
)
@pytest.mark.parametrize("num_ids", [8, 80], ids=["register kernel", "large kernel"])
def test_a_bad_launch_setting_is_refused_before_anything_changes(device, setting, message, num_ids):
    tables = SlotTables.allocate(8, 4, 1, torch.device(device))
    ids = torch.arange(num_ids, device=device).reshape(-1, 2) % 8
    before = tables.buffer.clone()
    out = torch.full_like(ids, -7)
    passes = torch.full(ids.shape, -7, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=message):
        admit(tables, ids, None, out, num_global=8, key_offset=0, layer=0, **setting)
    with pytest.raises(ValueError, match=message):
        assign_passes(tables, ids, None, passes, num_global=8, key_offset=0, **setting)
    assert torch.equal(tables.buffer, before) and bool((out == -7).all()) and bool((passes == -7).all())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("has_plan", [False, True])
def test_commit_equals_reference(device, has_plan):
    gen = torch.Generator().manual_seed(int(has_plan))
    num_keys, num_slots = 12, 5
    kernel, reference = (SlotTables.allocate(num_keys, num_slots, 2, torch.device(device)) for _ in range(2))
    for tables in (kernel, reference):
        put = dict(dtype=torch.int32, device=device)
        tables.expert_to_slot[torch.tensor([2, 7, 9], device=device)] = torch.tensor([0, 1, 3], **put)
        tables.slot_to_key[torch.tensor([0, 1, 3], device=device)] = torch.tensor([2, 7, 9], **put)
        tables.plan[: 1 + 8] = torch.tensor([2, 4, 3, 10, 9, 5, 2, 11, -1], **put)  # evict 9, fill 2
    mapping = torch.randperm(6, generator=gen).int().to(device)
    ids = torch.tensor([[0, 3, 5], [1, 0, 6]], device=device)  # 6 is out of the 6-entry map
    outs = [torch.full_like(ids, -7) for _ in range(2)]
    kwargs = dict(counts=(3, 2, 1), has_plan=has_plan, num_global=6, key_offset=6, layer=1)
    commit_plan(kernel, ids, mapping, outs[0], **kwargs)
    commit_plan_torch(reference, ids, mapping, outs[1], **kwargs)
    assert torch.equal(outs[0], outs[1])
    _same_tables(kernel, reference)
    assert kernel.counters[1].tolist() == [3, 2, 1, 1, 0, 0]
    if has_plan:
        assert int(kernel.expert_to_slot[9]) == -1 and int(kernel.expert_to_slot[10]) == 3


# per-expert shapes and dtypes: bf16 matrices, a lone fp32 scale, an int8 row of odd length
# (the copy word drops to 1 byte), more tensors than one launch takes (9 > 8).
LAYOUTS = [
    pytest.param([((6, 5), torch.bfloat16), ((5, 3), torch.bfloat16), ((), torch.float32)], id="bf16+scale"),
    pytest.param([((4, 4), torch.float32), ((3,), torch.int8)], id="odd bytes"),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("specs", LAYOUTS)
def test_copy_kernel_equals_reference(device, specs):
    gen = torch.Generator().manual_seed(len(specs))
    layout = ExpertLayout(tuple(ExpertTensorSpec(f"t{i}", shape, dtype) for i, (shape, dtype) in enumerate(specs)))
    num_experts, num_slots = 7, 5
    source = torch.randint(0, 256, (layout.buffer_bytes(num_experts),), generator=gen, dtype=torch.uint8)
    if device == "cuda":
        source = source.pin_memory()
    block = 4  # several chunks per tensor, a ragged last one
    segments = build_segments(
        layout.region_offsets(num_experts), tuple(s.nbytes for s in layout.specs), layout.copy_unit, block
    )
    kernel = layout.allocate(num_slots, torch.device(device), 0xFF)
    expected = {name: t.clone() for name, t in kernel.items()}
    plan = torch.tensor([3, 6, 4, 0, 0, 0, 1, 0, 0, 2, 2, 0, 0] + [9] * 8, dtype=torch.int32, device=device)
    landed = torch.tensor([5, 0, 2, 9, 1], dtype=torch.int32, device=device)  # what earlier copies left
    expected_landed = landed.cpu().clone()
    copy_experts(
        source, list(kernel.values()), CopyPlan.of(plan), segments,
        unit=layout.copy_unit, num_experts=num_experts, num_programs=3, landed=landed,
    )  # fmt: skip
    copy_experts_torch(source, list(expected.values()), CopyPlan.of(plan.cpu()), segments, unit=layout.copy_unit,
                       landed=expected_landed)  # fmt: skip
    for name in kernel:
        assert torch.equal(kernel[name].view(torch.uint8), expected[name].view(torch.uint8)), name
    # each of the three copies counted every chunk of its expert into its slot, once
    chunks = segments.chunks_per_expert
    assert chunks > 3 and landed.tolist() == [5, 0 + chunks, 2 + chunks, 9, 1 + chunks]
    assert torch.equal(landed.cpu(), expected_landed)
    # counted per segment (the first 1 a chunk, the others 1000): the same copies again
    counts = (1,) + (1000,) * (len(segments.words) - 1)
    copy_experts(
        source, list(kernel.values()), CopyPlan.of(plan), segments,
        unit=layout.copy_unit, num_experts=num_experts, num_programs=3, landed=landed, landed_counts=counts,
    )  # fmt: skip
    copy_experts_torch(source, list(expected.values()), CopyPlan.of(plan.cpu()), segments, unit=layout.copy_unit,
                       landed=expected_landed, landed_counts=counts)  # fmt: skip
    per_chunk = segment_chunks(segments)
    weighted = per_chunk[0] + 1000 * sum(per_chunk[1:])
    assert sum(per_chunk) == chunks and landed.tolist() == [5, chunks + weighted, 2 + chunks + weighted, 9,
                                                            1 + chunks + weighted]  # fmt: skip
    assert torch.equal(landed.cpu(), expected_landed)
    stored = layout.views(source, num_experts)
    assert torch.equal(kernel["t0"][4].cpu(), stored["t0"][6]) and torch.equal(kernel["t1"][1].cpu(), stored["t1"][0])
    assert bool((kernel["t0"][3].view(torch.uint8) == 0xFF).all())  # untouched slot keeps its poison


@pytest.mark.parametrize("device", devices())
def test_moe_apply_equals_reference_and_counts_bad_ids(device):
    gen = torch.Generator().manual_seed(4)
    dtype, tolerance = (torch.float32, 1e-5) if device == "cpu" else (torch.bfloat16, 2e-2)
    w = {k: v.to(device) for k, v in random_weights(5, 24, 16, dtype=dtype, generator=gen).items()}
    ids = random_topk(4, 3, 5, generator=gen)
    ids[0, 1], ids[2, 0], ids[3, 2] = -1, 5, 2**40  # skip; one past the end; far out (no fault)
    ids[1, 1] = -9
    x = torch.randn(4, 24, generator=gen).to(device, dtype)
    router = torch.rand(4, 3, generator=gen).to(device)
    invalid = torch.zeros(1, dtype=torch.int64, device=device)
    ours = moe_apply(x, w["w1"], w["w2"], router, ids.to(device), invalid_ids=invalid)
    reference = moe_apply_torch(x, w["w1"], w["w2"], router, ids.to(device))
    torch.testing.assert_close(ours.float(), reference.float(), atol=tolerance, rtol=tolerance)
    assert int(invalid) == 3  # 5, 2**40 and -9; -1 is a skip, not an error


@pytest.mark.parametrize("device", devices())
def test_moe_apply_checks_scales(device):
    w = {k: v.to(device) for k, v in random_weights(4, 40, 24).items()}
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    x, router = torch.randn(1, 40, device=device), torch.rand(1, 2, device=device)
    # blocks of 16: ceil(48/16), ceil(40/16)
    good1, good2 = torch.ones(4, 3, 3, device=device), torch.ones(4, 3, 2, device=device)
    moe_apply(x, w["w1"], w["w2"], router, ids, w1_scale=good1, w2_scale=good2, scale_block=16)
    with pytest.raises(ValueError, match="w1_scale must be"):
        moe_apply(x, w["w1"], w["w2"], router, ids, w1_scale=good1[:, :2], w2_scale=good2, scale_block=16)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        moe_apply(x, w["w1"], w["w2"], router, ids, w1_scale=good1.transpose(1, 2).contiguous().transpose(1, 2),
                  w2_scale=good2, scale_block=16)  # fmt: skip
    with pytest.raises(ValueError, match="both"):
        moe_apply(x, w["w1"], w["w2"], router, ids, w1_scale=good1)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode, mover", [("host", "kernel"), ("device", "kernel"), ("host", "engine")])
def test_nine_tensors_take_two_copy_launches(device, mode, mover):
    """More registered tensors than one launch writes (9 > 8): every one lands, byte for byte."""
    from expertcache import CachedWeightProvider, SlotPool

    gen = torch.Generator().manual_seed(9)
    weights = random_weights(6, 8, 4, generator=gen)
    weights.update({f"extra{i}": torch.randn(6, i + 1, generator=gen) for i in range(7)})
    pool = SlotPool.for_weights(weights, 3, device=device, mode=mode, mover=mover)
    provider = CachedWeightProvider(weights, pool=pool)
    for ids in ([[0, 1]], [[2, 3]], [[4, 1]], [[5, 0]]):
        result = provider.prepare(torch.tensor(ids, device=device))
        for expert in provider.resident():
            slot = provider.slot_of(expert)
            for name in weights:
                held = {"w1": result.w1, "w2": result.w2, **result.extra}[name]
                assert torch.equal(held[slot].cpu(), weights[name][expert]), name


def test_decode_launches_chain_only_where_the_gpu_can(monkeypatch):
    """Programmatic dependent launch: compiled kernels on sm_90+ only, and off when asked."""
    from expertcache.kernels import _launch

    assert _launch.chained(torch.device("cpu")) == {"PDL": False}
    if torch.cuda.is_available() and not _launch.interpreted():
        can = torch.cuda.get_device_capability()[0] >= 9
        assert _launch.chains_launches(torch.device("cuda")) == can
        assert _launch.chained(torch.device("cuda")) == ({"PDL": True, "launch_pdl": True} if can else {"PDL": False})
    monkeypatch.setattr(_launch, "PROGRAMMATIC_LAUNCH", False)
    assert _launch.chained(torch.device("cuda")) == {"PDL": False}
