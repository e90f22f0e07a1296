"""Exponent coding of bf16/fp16 experts: the codec round-trips every bit pattern, the decoding
copy kernel equals its torch reference byte for byte, and a store coded that way serves the
same slots (and outputs) as a raw one. Interpreted on a CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import devices

from expertcache.compression import encode
from expertcache.exponent_analysis import analyse
from expertcache.exponent_code import ExponentCode
from expertcache.exponent_decode import decode_records_torch
from expertcache.kernels.copy_experts import CopyPlan
from expertcache.kernels.decode_copy import build_decode_segments, decode_copy, decode_copy_torch, scratch_bytes

FLOATS = [torch.bfloat16, torch.float16]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` (any dtype, any shape): what a bit-exact comparison compares."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def specials(dtype: torch.dtype) -> torch.Tensor:
    """NaNs (two payloads, both signs), infinities, signed zeros, denormals, extremes."""
    info = torch.finfo(dtype)
    values = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, info.tiny, -info.tiny, info.max, info.min,
         info.tiny / 4, -info.tiny / 8, info.smallest_normal * 0.5, 1.0, -1.0],
        dtype=torch.float32,
    ).to(dtype)  # fmt: skip
    payload = torch.tensor([0x7FC1, -0x0001], dtype=torch.int16).view(dtype)  # a quiet NaN, a negative one
    return torch.cat([values, payload])


def with_specials(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    out = tensor.clone().reshape(-1)
    special = specials(tensor.dtype)
    where = torch.randperm(out.numel(), generator=torch.Generator().manual_seed(seed))[: special.numel()]
    out[where] = special
    return out.view(tensor.shape)


# (shape of one expert, block): several blocks and a ragged last one; one value; one block exactly;
# a block of 16 (the smallest); the default block over two blocks.
SHAPES = [
    pytest.param((37, 29), 64, id="ragged blocks"),
    pytest.param((1,), 16, id="one value"),
    pytest.param((8, 16), 128, id="one whole block"),
    pytest.param((5, 3), 16, id="smallest block"),
    pytest.param((9000,), 8192, id="default block"),
]


#: (code_bits, second_bits): every width of one level, and two levels of several widths.
CODES = [(2, 0), (3, 0), (4, 0), (2, 2), (2, 3), (3, 3)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape, block", SHAPES)
@pytest.mark.parametrize("code_bits, second_bits", CODES)
def test_reference_decoder_round_trips(dtype, shape, block, code_bits, second_bits):
    gen = torch.Generator().manual_seed(code_bits)
    tensor = (torch.randn(3, *shape, generator=gen) * 0.02).to(dtype)
    tensor = with_specials(tensor, code_bits) if tensor.numel() > 40 else tensor
    fmt, records = encode(tensor, ExponentCode(dtype, code_bits, block, second_bits=second_bits))
    assert records.shape == (3, fmt.record_bytes) and fmt.record_bytes % 16 == 0
    assert torch.equal(bits(decode_records_torch(records, fmt)), bits(tensor.reshape(3, -1)))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("second_bits", [0, 3])
def test_every_bit_pattern_round_trips(dtype, second_bits):
    """All 65536 patterns, shuffled: nearly every exponent occurs, so most values escape
    every level and the exceptions run long."""
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    shuffled = patterns[torch.randperm(patterns.numel(), generator=torch.Generator().manual_seed(0))]
    tensor = shuffled.view(dtype).view(4, 128, 128)
    fmt, records = encode(tensor, ExponentCode(dtype, 3, 256, second_bits=second_bits))
    assert torch.equal(bits(decode_records_torch(records, fmt)), bits(tensor.reshape(4, -1)))
    assert not fmt.pays()  # uniform bit patterns do not compress: the store keeps them raw


@pytest.mark.parametrize("scale", [0.002, 0.005, 0.02, 0.1])
def test_normal_bf16_compresses_to_under_0_69_and_one_level_to_under_0_71(scale):
    """Normal weights (benchmarks/compression_ratio.py): the default two levels take 8 + 2 bits
    a value, 3 more for the ~27% escaped and ~0.4% exceptions; one level of 3 bits 8 + 3 and
    ~2% exceptions."""
    tensor = (torch.randn(4, 256, 1024, generator=torch.Generator().manual_seed(1)) * scale).to(torch.bfloat16)
    two = analyse(tensor, ExponentCode(torch.bfloat16)).format
    one = analyse(tensor, ExponentCode(torch.bfloat16, 3, second_bits=0)).format
    assert two.pays() and two.record_bytes / two.raw_bytes < 0.69
    assert one.pays() and 0.69 < one.record_bytes / one.raw_bytes < 0.71


def test_bad_codes_and_tensors_are_refused():
    with pytest.raises(ValueError, match="bfloat16 and float16"):
        ExponentCode(torch.float32)
    with pytest.raises(ValueError, match="code_bits"):
        ExponentCode(torch.bfloat16, code_bits=5)
    with pytest.raises(ValueError, match="power of two"):
        ExponentCode(torch.bfloat16, block=100)
    with pytest.raises(ValueError, match="second_bits"):
        ExponentCode(torch.bfloat16, second_bits=1)
    with pytest.raises(ValueError, match="second_bits"):
        ExponentCode(torch.bfloat16, code_bits=3, second_bits=4)
    with pytest.raises(ValueError, match="the codebook holds 16"):
        ExponentCode(torch.bfloat16, code_bits=4)  # 15 + 7 entries
    with pytest.raises(TypeError):
        ExponentCode(torch.bfloat16, 3, 64, 0)  # second_bits is keyword-only
    for bad in ({"second_bits": False}, {"code_bits": 3.0}, {"block": "8192"}):
        with pytest.raises(TypeError, match="must be an int"):
            ExponentCode(torch.bfloat16, **bad)
    with pytest.raises(ValueError, match="the tensor is torch.float16"):
        analyse(torch.zeros(2, 4, dtype=torch.float16), ExponentCode(torch.bfloat16))


def _source(tensors: list[torch.Tensor], code: ExponentCode, device: str):
    """A store-like buffer: one 256-aligned region of records per tensor (raw bytes between)."""
    formats, records, offsets, cursor = [], [], [], 0
    for tensor in tensors:
        fmt, record = encode(tensor, code)
        formats.append(fmt)
        records.append(record)
        offsets.append(cursor)
        cursor = -(-(cursor + record.numel()) // 256) * 256
    source = torch.randint(0, 256, (cursor,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    for offset, record in zip(offsets, records, strict=True):
        source[offset : offset + record.numel()] = record.reshape(-1)
    if device == "cuda":
        source = source.pin_memory()
    return source, build_decode_segments(tuple(offsets), tuple(formats))


def _plan(device: str) -> CopyPlan:
    # copies: expert 4 -> slot 0, 1 -> 2, 0 -> 3, then a row out of range and a slot out of
    # range (both skipped); the rest of the plan is poison that a count of 5 never reads
    entries = [4, 0, 0, 0, 1, 2, 0, 0, 0, 3, 0, 0, 9, 1, 0, 0, 2, 7, 0, 0]
    return CopyPlan.of(torch.tensor([5, *entries, *[3] * 8], dtype=torch.int32, device=device))


def _check_kernel(tensors: list[torch.Tensor], code: ExponentCode, device: str, num_programs: int = 3) -> None:
    source, segments = _source(tensors, code, device)
    slots = [torch.full((4, *t.shape[1:]), -7.0, dtype=t.dtype, device=device) for t in tensors]
    expected = [t.cpu().clone() for t in slots]
    decode_copy(source, slots, _plan(device), segments, num_experts=tensors[0].shape[0], num_programs=num_programs)
    decode_copy_torch(source, expected, _plan("cpu"), segments, num_experts=tensors[0].shape[0])
    for slot, reference, tensor in zip(slots, expected, tensors, strict=True):
        assert torch.equal(bits(slot.cpu()), bits(reference))
        for slot_id, expert in ((0, 4), (2, 1), (3, 0)):
            assert torch.equal(bits(slot[slot_id].cpu()), bits(tensor[expert]))
        assert bool((slot[1] == -7.0).all())  # an unplanned slot is untouched


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "code_bits, block, second_bits", [(3, 64, 0), (2, 32, 3), (4, 16, 0), (2, 64, 2), (3, 16, 3), (3, 32, 2)]
)
def test_decode_kernel_equals_reference(device, dtype, code_bits, block, second_bits):
    """Four names in one launch (the most): ragged blocks, one value, specials, a wide scale."""
    gen = torch.Generator().manual_seed(block)
    tensors = [
        with_specials((torch.randn(5, 37, 29, generator=gen) * 0.002).to(dtype), 1),
        (torch.randn(5, 1, generator=gen) * 0.1).to(dtype),
        with_specials((torch.randn(5, 3 * block, generator=gen) * 0.05).to(dtype), 2),
        (torch.randn(5, 2, 17, generator=gen) * torch.logspace(-6, 2, 34).view(2, 17)).to(dtype),
    ]
    _check_kernel(tensors, ExponentCode(dtype, code_bits, block, second_bits=second_bits), device)


@pytest.mark.parametrize("device", devices())
def test_decode_kernel_mixes_names_with_and_without_second_codes(device):
    """A name that never escapes (spill 0) beside coded ones in one launch of more programs
    than work items; then a plan of no copies writes nothing."""
    gen = torch.Generator().manual_seed(5)
    constant = torch.full((5, 40), 0.375).to(torch.bfloat16)
    tensors = [constant, with_specials((torch.randn(5, 100, generator=gen) * 0.02).to(torch.bfloat16), 6)]
    code = ExponentCode(torch.bfloat16, block=16)
    source, segments = _source(tensors, code, device)
    assert segments.formats[0].spill == 0 and segments.formats[1].spill > 0
    _check_kernel(tensors, code, device, num_programs=64)  # 3 copies x 10 blocks: 30 items
    slots = [torch.full((4, *t.shape[1:]), -7.0, dtype=t.dtype, device=device) for t in tensors]
    nothing = CopyPlan.of(torch.zeros(29, dtype=torch.int32, device=device))
    decode_copy(source, slots, nothing, segments, num_experts=5, num_programs=3)
    assert all(bool((slot == -7.0).all()) for slot in slots)


@pytest.mark.parametrize("device", devices())
def test_decode_kernel_default_block(device):
    """The default code (2 + 3 bits, 8192 values): two blocks, the second ragged, one program per copy."""
    tensor = with_specials((torch.randn(5, 9000, generator=torch.Generator().manual_seed(3)) * 0.02), 4)
    _check_kernel([tensor.to(torch.bfloat16)], ExponentCode(torch.bfloat16), device, num_programs=5)


def test_decode_launcher_refuses_bad_arguments():
    tensor = (torch.randn(3, 40) * 0.02).to(torch.bfloat16)
    source, segments = _source([tensor], ExponentCode(torch.bfloat16, 3, 16), "cpu")
    plan = _plan("cpu")
    with pytest.raises(ValueError, match="contiguous torch.bfloat16"):
        decode_copy(source, [torch.zeros(4, 40, dtype=torch.float16)], plan, segments, num_experts=3)
    with pytest.raises(ValueError, match="cannot take records"):
        decode_copy(source, [torch.zeros(4, 41, dtype=torch.bfloat16)], plan, segments, num_experts=3)
    with pytest.raises(ValueError, match="scratch"):
        small = torch.zeros(scratch_bytes(segments, 2) - 1, dtype=torch.uint8)
        decode_copy(source, [torch.zeros(4, 40, dtype=torch.bfloat16)], plan, segments, num_experts=3, scratch=small)
    with pytest.raises(ValueError, match="one code"):
        other = analyse(tensor.half(), ExponentCode(torch.float16, 3, 16)).format
        build_decode_segments((0, 256), (segments.formats[0], other))


@pytest.mark.parametrize("device", devices())
def test_decode_kernel_on_every_random_familys_experts(device):
    """The bf16 expert tensors of each family (matrices, GPT-OSS biases), three blocks each or more."""
    pytest.importorskip("transformers")
    from expertcache.integrations.transformers.discovery import find_expert_blocks
    from expertcache.integrations.transformers.random_models import FAMILIES, ModelSizes, random_model

    sizes = ModelSizes(num_moe_layers=1, num_experts=5, hidden=32, intermediate=24)
    for family in FAMILIES:
        block = find_expert_blocks(random_model(family, sizes, dtype=torch.bfloat16))[0]
        tensors = [block.module.get_parameter(name).detach() for name in block.parameter_names]
        tensors = [t for t in tensors if t.dtype == torch.bfloat16]
        for start in range(0, len(tensors), 4):  # a launch decodes up to four names
            _check_kernel(tensors[start : start + 4], ExponentCode(torch.bfloat16, block=256), device)


# -- the store option ---------------------------------------------------------------------

from helpers import random_topk, random_weights, slot_bytes  # noqa: E402

from expertcache import CachedWeightProvider, SlotPool  # noqa: E402
from expertcache.decode_stack import DecodeStack  # noqa: E402
from expertcache.reference import moe_forward  # noqa: E402
from expertcache.store import CPUBackingStore  # noqa: E402


def coded_weights(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """9 experts, H 64, I 40: w1/w2 and a long bias pay for the code; fp32 scales stay raw."""
    weights = random_weights(9, 64, 40, dtype=dtype, extras=True, generator=torch.Generator().manual_seed(seed))
    weights["bias"] = torch.randn(9, 512, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    weights["w2"] = with_specials(weights["w2"], seed)
    return weights


def served_pair(device: str, kind: str, weights: dict[str, torch.Tensor]):
    """The same cache built raw and coded: a private host pool (engine mover), a shared host
    pool with the copy kernel mover, or device mode."""
    mode = "device" if kind == "device" else "host"
    out = []
    for compression in (None, "exponent"):
        if kind == "shared kernel mover":
            pool = SlotPool.for_weights(weights, 4, device=device, mode="host", mover="kernel")
            out.append(CachedWeightProvider(weights, pool=pool, compression=compression))
        else:
            out.append(CachedWeightProvider(weights, cache_size=4, device=device, mode=mode, compression=compression))
    return out


def public_views(provider) -> tuple:
    stats = provider.stats
    counters = (stats.hits, stats.misses, stats.evictions, stats.bytes_h2d, stats.calls)
    return counters, provider.resident(), [provider.slot_of(e) for e in range(provider.num_experts)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", ["host", "shared kernel mover", "device"])
def test_coded_store_serves_the_same_slots(device, kind):
    weights = coded_weights()
    raw, coded = served_pair(device, kind, weights)
    assert set(coded.store.formats) == {"w1", "w2", "bias"}  # the fp32 scales stay raw
    gen = torch.Generator().manual_seed(3)
    for step in range(8):
        ids = random_topk(2, 2, 9, generator=gen).to(device)
        a, b = raw.prepare(ids), coded.prepare(ids)
        assert torch.equal(a.topk_ids, b.topk_ids), step
        assert all(
            torch.equal(x, y)
            for x, y in zip(slot_bytes(raw.pool).values(), slot_bytes(coded.pool).values(), strict=True)
        )
        assert public_views(raw) == public_views(coded), step
    for expert in coded.resident():
        for name in weights:
            assert torch.equal(bits(coded.pool.tensors[name][coded.slot_of(expert)].cpu()), bits(weights[name][expert]))
    stats = coded.stats
    assert raw.stats.compressed_bytes_h2d == raw.stats.bytes_h2d > 0
    assert stats.compressed_bytes_h2d == stats.misses * coded.store.stored_expert_bytes < 0.8 * stats.bytes_h2d


@pytest.mark.parametrize("device", devices())
def test_coded_store_outputs_equal_raw_ones(device):
    """moe_forward over the served slots (bf16), and a two-layer decode stack (fp16), are identical."""
    weights = coded_weights()
    raw, coded = served_pair(device, "device", weights)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 64, generator=gen).to(device, torch.bfloat16)
    router = torch.rand(2, 2, generator=gen).to(device, torch.bfloat16)
    ids = random_topk(2, 2, 9, generator=gen).to(device)
    outs = [moe_forward(hidden, r.w1, r.w2, router, r.topk_ids) for r in (raw.prepare(ids), coded.prepare(ids))]
    assert torch.equal(bits(outs[0]), bits(outs[1]))  # bytes: the specials make NaNs
    layers = [{n: w for n, w in coded_weights(torch.float16, seed).items() if n in ("w1", "w2")} for seed in (1, 2)]
    stacks = []
    for compression in (None, "exponent"):
        cached = [
            CachedWeightProvider(w, cache_size=4, device=device, mode="device", compression=compression) for w in layers
        ]
        stacks.append(DecodeStack(cached, 64, 9, dtype=torch.float16, device=device))
    routing = torch.stack([random_topk(2, 2, 9, generator=gen) for _ in range(2)]).to(device)
    h = torch.randn(2, 64, generator=gen).to(device, torch.float16)
    assert torch.equal(bits(stacks[0].step(h, routing)), bits(stacks[1].step(h, routing)))


def test_coded_store_decodes_on_read_and_rolls_back(monkeypatch):
    """``store.tensors`` / ``store.expert`` give the exact weights; a failed call restores the
    slots it overwrote from the coded records (host mode, injected failure)."""
    import expertcache.host_prepare as host_prepare

    weights = coded_weights()
    store = CPUBackingStore(SlotPool.for_weights(weights, 1).layout, weights, pin=False, compression="exponent")
    assert store.compression == "exponent" and set(store.tensors) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(bits(store.tensors[name]), bits(tensor))
        assert torch.equal(bits(store.expert(name, 4)), bits(tensor[4]))
    provider = CachedWeightProvider(store, cache_size=2, device="cpu")
    provider.prepare(torch.tensor([[0, 1]]))
    before = slot_bytes(provider.pool)

    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(host_prepare, "commit_plan", fail)
    with pytest.raises(RuntimeError, match="injected"):
        provider.prepare(torch.tensor([[2, 3]]))  # both slots overwritten, then restored
    assert all(torch.equal(before[n], after) for n, after in slot_bytes(provider.pool).items())


def test_bad_compression_is_refused_and_changes_nothing():
    weights = coded_weights()
    pool = SlotPool.for_weights(weights, 4)
    with pytest.raises(ValueError, match=r"one of \('exponent',\), got 'zstd'"):
        CachedWeightProvider(weights, pool=pool, compression="zstd")
    fp32 = random_weights(9, 64, 40)
    with pytest.raises(ValueError, match="bfloat16 or float16 experts"):
        CachedWeightProvider(fp32, pool=SlotPool.for_weights(fp32, 4), compression="exponent")
    assert not pool.layers  # nothing attached
    store = CPUBackingStore(pool.layout, weights, pin=False)
    with pytest.raises(ValueError, match="compression applies when the store is built"):
        CachedWeightProvider(store, cache_size=4, compression="exponent")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        CPUBackingStore(SlotPool.for_weights(fp32, 1).layout, fp32, pin=False, compression="exponent")


def test_manifest_reports_stored_bytes(tmp_path):
    from expertcache.manifest import Manifest

    weights = coded_weights()
    raw, coded = (CachedWeightProvider(weights, cache_size=4, device="cpu", compression=c) for c in (None, "exponent"))
    plain, packed = raw.manifest(), coded.manifest()
    assert plain.compression is None and plain.compressed_expert_bytes == plain.expert_bytes
    assert packed.compression == "exponent" and packed.expert_bytes == plain.expert_bytes
    assert packed.compressed_expert_bytes == coded.store.stored_expert_bytes < 0.8 * plain.expert_bytes
    assert packed.host_bytes < plain.host_bytes
    packed.write(tmp_path / "m.json")
    assert Manifest.read(tmp_path / "m.json") == packed


def test_host_mode_without_kernels_decodes_with_the_reference(monkeypatch):
    """On a CPU without the interpreter the mover falls back to `decode_copy_torch`."""
    import expertcache.mover as mover

    monkeypatch.setattr(mover, "runs_on", lambda tensor: False)
    weights = coded_weights()
    provider = CachedWeightProvider(weights, cache_size=3, device="cpu", compression="exponent")
    provider.prepare(torch.tensor([[5, 2], [7, 5]]))
    for expert in (2, 5, 7):
        slot = provider.slot_of(expert)
        assert all(torch.equal(bits(provider.pool.tensors[n][slot]), bits(w[expert])) for n, w in weights.items())
