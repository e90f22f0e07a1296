"""The quantised apply kernels (GEMV and grouped) equal the dequantising reference; a slot
pool serves packed tensors bit for bit and the kernels read them in place; the unquantised
format (``"none"``) runs the same MLP options and equals MXFP4 on weights both hold exactly.

Interpreted on a CPU (GEMV: fp32 and bf16 activations; grouped: fp32 and fp16, the
interpreter's bf16 products being wrong), compiled on a GPU (bf16 too, and model-sized
shapes). Unquantised weights take the activations' dtype unless a test says otherwise. The
weights sit between poisoned experts (fp8 NaN bytes, e8m0 code 255, NaN weights and
biases), so a kernel that read outside ``[0, N)`` would give NaN.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import HAS_CUDA, devices
from helpers import random_topk

from expertcache import CachedWeightProvider
from expertcache.kernels import moe_apply_quant, moe_apply_quant_grouped, moe_apply_quant_passes, moe_apply_quant_torch
from expertcache.kernels.quant_apply import Tile, launch_down, launch_gate_up
from expertcache.kernels.quant_common import E2M1_PAIR_UNSCALE, FORMAT_CODES, e2m1_pair_to_float, quant_operands
from expertcache.kernels.quant_passes import QUANT_GROUPED_MIN_PAIRS
from expertcache.quant import FP8_BLOCK_128, FP8_PER_TENSOR, GPT_OSS_BF16, GPT_OSS_MXFP4, QuantScheme, unquantized
from expertcache.quant_mxfp4 import E2M1_VALUES
from expertcache.quant_tensors import dequantize_experts, quantize_experts, weights_of

SCHEMES = [
    pytest.param(FP8_PER_TENSOR, id="fp8-tensor"),
    pytest.param(QuantScheme("fp8", fp8_block=(16, 16)), id="fp8-block16"),  # many blocks at small shapes
    pytest.param(QuantScheme("fp8", fp8_block=(8, 32)), id="fp8-block8x32"),  # rectangular blocks
    pytest.param(GPT_OSS_MXFP4, id="mxfp4-gpt-oss"),
    # the options are independent of the format:
    pytest.param(
        QuantScheme("fp8", fp8_block=(16, 16), gate_up="interleaved", activation="swiglu_oai", has_bias=True),
        id="fp8-oai-bias",
    ),  # fmt: skip
    pytest.param(QuantScheme("mxfp4"), id="mxfp4-silu"),
    pytest.param(GPT_OSS_BF16, id="none-gpt-oss"),  # unquantised: interleaved, clamped SwiGLU, biases
    pytest.param(QuantScheme("none"), id="none-silu"),  # unquantised: concatenated, SiLU, no biases
]

SHAPES = [
    (1, 1, 1, 16, 16),  # one token, one expert, top-1
    (1, 4, 6, 40, 24),  # decode T=1; H, I not multiples of the blocks or of 32
    (3, 5, 5, 48, 40),  # K = E, prime E: every token in every expert
    (9, 2, 7, 72, 20),  # several K steps, ragged last step and row block
]

# activation dtype and tolerance (relative to the output's largest magnitude)
GEMV_DTYPES = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 1e-2, id="bf16")]
GROUPED_DTYPES = [
    pytest.param(torch.float32, 1e-5, id="fp32"),
    pytest.param(torch.float16, 4e-3, id="fp16"),
    pytest.param(torch.bfloat16, 2e-2, id="bf16", marks=pytest.mark.gpu),
]


def float_experts(num_experts, hidden, inter, gen, *, gain=1.0):
    return (
        torch.randn(num_experts, 2 * inter, hidden, generator=gen) * gain / hidden**0.5,
        torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5,
        torch.randn(num_experts, 2 * inter, generator=gen) * 0.5,
        torch.randn(num_experts, hidden, generator=gen) * 0.1,
    )


def quantize(scheme, floats, dtype):
    """``scheme``'s tensors; unquantised weights in ``dtype`` (the activations')."""
    given = floats if scheme.has_bias else floats[:2]  # biases only where the scheme registers them
    return quantize_experts(scheme, *given, **({"dtype": dtype} if scheme.format == "none" else {}))


def poisoned(tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Each tensor as the view ``[1:-1]`` of a buffer whose entries -1 and N are poison."""
    out = {}
    for name, tensor in tensors.items():
        buffer = torch.empty(tensor.shape[0] + 2, *tensor.shape[1:], dtype=tensor.dtype)
        if tensor.dtype == torch.float8_e4m3fn:
            buffer.view(torch.uint8).fill_(0x7F)  # NaN
        elif tensor.dtype == torch.uint8:
            buffer.fill_(255)  # e8m0 NaN (decodes to inf); blocks: -6
        else:
            buffer.fill_(float("nan"))
        buffer[1:-1] = tensor
        out[name] = buffer.to(device)[1:-1]
    return out


def call(scheme, tokens, top_k, num_experts, hidden, inter, *, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = quantize(scheme, float_experts(num_experts, hidden, inter, gen, gain=4.0), dtype)
    ids = random_topk(tokens, top_k, num_experts, generator=gen)
    if top_k > 1:
        ids[0, -1] = -1  # a skipped choice contributes nothing
        ids[-1, 0] = num_experts  # out of range: skipped and counted
    x = (torch.randn(tokens, hidden, generator=gen) * 2).to(dtype)
    router = torch.rand(tokens, top_k, generator=gen)
    return x.to(device), poisoned(tensors, device), router.to(device), ids.to(device)


def check(ours, reference, dtype, tolerance):
    assert ours.dtype == dtype and not ours.isnan().any()
    scale = reference.float().abs().max().clamp(min=1.0)
    torch.testing.assert_close(ours.float(), reference.float(), atol=tolerance * scale, rtol=tolerance)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype, tolerance", GEMV_DTYPES)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tokens, top_k, num_experts, hidden, inter", SHAPES)
def test_gemv_matches_reference(device, dtype, tolerance, scheme, tokens, top_k, num_experts, hidden, inter):
    x, tensors, router, ids = call(scheme, tokens, top_k, num_experts, hidden, inter, dtype=dtype, device=device)
    invalid = torch.zeros(1, dtype=torch.int64, device=device)
    ours = moe_apply_quant(x, tensors, router, ids, scheme=scheme, invalid_ids=invalid)
    check(ours, moe_apply_quant_torch(x, tensors, router, ids, scheme=scheme), dtype, tolerance)
    assert invalid.item() == (1 if top_k > 1 else 0)


@triton.jit
def _decode_bytes(packed_ptr, low_ptr, high_ptr):
    index = tl.arange(0, 256)
    low, high = e2m1_pair_to_float(tl.load(packed_ptr + index))
    tl.store(low_ptr + index, low * E2M1_PAIR_UNSCALE)
    tl.store(high_ptr + index, high * E2M1_PAIR_UNSCALE)


@pytest.mark.parametrize("device", devices())
def test_e2m1_pair_decode_is_exact_for_every_byte(device):
    packed = torch.arange(256, dtype=torch.uint8, device=device)
    low, high = torch.empty(256, device=device), torch.empty(256, device=device)
    _decode_bytes[(1,)](packed, low, high)
    table = torch.tensor(E2M1_VALUES, device=device)
    for ours, codes in ((low, packed.long() & 0xF), (high, packed.long() >> 4)):
        assert torch.equal(ours, table[codes]) and torch.equal(ours.signbit(), table[codes].signbit())


# (gate_up, down) tiles beside the library's: both accumulations, steps shorter than a row
TILES = [
    pytest.param((Tile(4, 16, 4, True), Tile(8, 32, 4, False)), id="sum-once-gate"),
    pytest.param((Tile(8, 64, 8, False), Tile(4, 16, 4, True)), id="sum-once-down"),
    pytest.param((Tile(16, 256, 4, True), Tile(32, 256, 8, True)), id="sum-once-both"),
    # K steps of several pieces, each with its own scale (fp8 and 16-bit; MXFP4 runs them as one piece)
    pytest.param((Tile(4, 16, 4, True, chunks=4), Tile(8, 16, 4, False, chunks=2)), id="pieces"),
    pytest.param((Tile(8, 32, 4, False, chunks=4), Tile(16, 64, 8, True, chunks=2)), id="pieces-swapped"),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_gemv_tile_matches_reference(device, tiles, scheme):
    tokens, top_k, num_experts, hidden, inter = SHAPES[-1]  # several K steps, ragged rows
    if scheme.format == "mxfp4":  # its steps are whole groups: no pieces
        tiles = tuple(tile._replace(chunks=1) for tile in tiles)
    x, tensors, router, ids = call(scheme, tokens, top_k, num_experts, hidden, inter, dtype=torch.float32,
                                   device=device)  # fmt: skip
    ops = quant_operands(x, tensors, router, ids, scheme)
    act = torch.empty(ids.numel(), inter, device=device)
    part = torch.full((ids.numel(), hidden), float("nan"), device=device)
    launch_gate_up(x, ops, ids, act, tiles[0])
    launch_down(act, ops, ids, router, part, True, tiles[1])
    served = (ids >= 0) & (ids < num_experts)
    ours = (part.view(tokens, top_k, hidden) * served[..., None]).sum(1)  # skipped rows are zeros
    assert not part.isnan().any()
    check(ours, moe_apply_quant_torch(x, tensors, router, ids, scheme=scheme), torch.float32, 1e-5)


@pytest.mark.parametrize(
    "tile, scheme, match",
    [
        (Tile(12, 128, 4, True), FP8_BLOCK_128, "rows must be a power of two"),
        (Tile(8, 128, 4, True, chunks=3), FP8_BLOCK_128, "chunks must be a power of two"),
        (Tile(8, 256, 4, True, chunks=2), GPT_OSS_MXFP4, "chunks must be 1"),  # would be ignored
    ],
)
@pytest.mark.parametrize("device", devices())
def test_a_tile_the_kernels_cannot_take_is_refused(device, tile, scheme, match):
    x, tensors, router, ids = call(scheme, 2, 2, 3, 64, 32, dtype=torch.float32, device=device)
    ops = quant_operands(x, tensors, router, ids, scheme)
    act = torch.full((ids.numel(), 32), 7.0, device=device)
    with pytest.raises(ValueError, match=match):
        launch_gate_up(x, ops, ids, act, tile)
    with pytest.raises(ValueError, match=match):
        launch_down(act, ops, ids, router, torch.empty(ids.numel(), 64, device=device), True, tile)
    assert (act == 7.0).all()  # refused before any launch


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype, tolerance", GROUPED_DTYPES)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tokens, top_k, num_experts, hidden, inter", SHAPES)
def test_grouped_matches_reference(device, dtype, tolerance, scheme, tokens, top_k, num_experts, hidden, inter):
    x, tensors, router, ids = call(scheme, tokens, top_k, num_experts, hidden, inter, dtype=dtype, device=device)
    invalid = torch.zeros(1, dtype=torch.int64, device=device)
    ours = moe_apply_quant_grouped(x, tensors, router, ids, scheme=scheme, invalid_ids=invalid)
    check(ours, moe_apply_quant_torch(x, tensors, router, ids, scheme=scheme), dtype, tolerance)
    assert invalid.item() == (1 if top_k > 1 else 0)


@pytest.mark.parametrize("device", devices())
def test_real_block_size_on_ragged_shapes(device):
    """DeepSeek's 128x128 blocks with H, I past one block and ragged (2 x 2 and 3 x 2 scales)."""
    x, tensors, router, ids = call(FP8_BLOCK_128, 2, 3, 4, 200, 136, dtype=torch.float32, device=device)
    reference = moe_apply_quant_torch(x, tensors, router, ids, scheme=FP8_BLOCK_128)
    assert tensors["w1_scale"].shape[1:] == (3, 2) and tensors["w2_scale"].shape[1:] == (2, 2)
    check(moe_apply_quant(x, tensors, router, ids, scheme=FP8_BLOCK_128), reference, torch.float32, 1e-5)
    grouped = moe_apply_quant_grouped(x, tensors, router, ids, scheme=FP8_BLOCK_128)
    check(grouped, reference, torch.float32, 1e-5)


@pytest.mark.parametrize("device", devices())
def test_no_choices_give_zeros(device):
    x, tensors, router, ids = call(GPT_OSS_MXFP4, 3, 2, 4, 32, 16, dtype=torch.float32, device=device)
    none = torch.full_like(ids, -1)
    for apply in (moe_apply_quant, moe_apply_quant_grouped):
        assert torch.equal(apply(x, tensors, router, none, scheme=GPT_OSS_MXFP4), torch.zeros_like(x))
        empty = apply(x[:0], tensors, router[:0], ids[:0], scheme=GPT_OSS_MXFP4)
        assert empty.shape == (0, 32)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "scheme", [FP8_BLOCK_128, GPT_OSS_MXFP4, GPT_OSS_BF16], ids=["fp8-block", "mxfp4", "none-gpt-oss"]
)
@pytest.mark.parametrize("mode", ["host", "device"])
def test_slots_serve_packed_tensors_bit_exactly(device, scheme, mode):
    """Each slot holds its expert's packed bytes; the kernels on the slots equal the full weights."""
    gen = torch.Generator().manual_seed(1)
    tensors = quantize(scheme, float_experts(10, 40, 24, gen), torch.bfloat16)  # fp32 tokens, bf16 weights
    full = {name: tensor.to(device) for name, tensor in tensors.items()}
    provider = CachedWeightProvider(tensors, cache_size=4, device=device, mode=mode)
    for _ in range(4):
        ids = random_topk(2, 2, 10, generator=gen).to(device)
        x = torch.randn(2, 40, generator=gen).to(device)
        router = torch.rand(2, 2, generator=gen).to(device)
        result = provider.prepare(ids)
        slots = weights_of(result)
        assert tuple(sorted(slots)) == tuple(sorted(scheme.names))
        for slot in range(4):
            expert = provider.expert_in(slot)
            if expert >= 0:
                for name in scheme.names:
                    assert torch.equal(_bytes(slots[name][slot]), _bytes(full[name][expert])), name
        for apply in (moe_apply_quant, moe_apply_quant_grouped):
            assert torch.equal(apply(x, result, router, result.topk_ids, scheme=scheme),
                               apply(x, full, router, ids, scheme=scheme))  # fmt: skip


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("kernel", ["gemv", "grouped"])
@pytest.mark.parametrize("scheme", [GPT_OSS_MXFP4, GPT_OSS_BF16], ids=["mxfp4", "none-gpt-oss"])
def test_passes_are_bit_identical_to_one_call(device, mode, kernel, scheme):
    gen = torch.Generator().manual_seed(2)
    tensors = quantize(scheme, float_experts(9, 32, 16, gen), torch.bfloat16)  # fp32 tokens, bf16 weights
    full = {name: tensor.to(device) for name, tensor in tensors.items()}
    provider = CachedWeightProvider(tensors, cache_size=3, device=device, mode=mode)
    one_call = moe_apply_quant if kernel == "gemv" else moe_apply_quant_grouped
    for _ in range(2):
        ids = random_topk(5, 3, 9, generator=gen).to(device)  # more experts than slots: passes
        x = torch.randn(5, 32, generator=gen).to(device)
        router = torch.rand(5, 3, generator=gen).to(device)
        ours = moe_apply_quant_passes(x, provider.passes(ids), router, scheme=scheme, kernel=kernel)
        assert torch.equal(ours, one_call(x, full, router, ids, scheme=scheme))


# ---- the unquantised format ---------------------------------------------------------------

# MXFP4 dequantised into each 16-bit dtype (exact: two significant bits, moderate exponents),
# tokens in fp32 (both formats multiply in fp32: only the summation order differs) or fp16
# (tensor-core products; the grouped kernel's fp16 act may round either way of a tie)
REPRESENTABLE = [
    pytest.param(torch.bfloat16, torch.float32, 1e-5, id="bf16-weights-fp32-tokens"),
    pytest.param(torch.float16, torch.float32, 1e-5, id="fp16-weights-fp32-tokens"),
    pytest.param(torch.float32, torch.float32, 1e-5, id="fp32-weights-fp32-tokens"),
    pytest.param(torch.float16, torch.float16, 4e-3, id="fp16-weights-fp16-tokens"),
    pytest.param(torch.bfloat16, torch.bfloat16, 2e-2, id="bf16-weights-bf16-tokens", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("weight_dtype, dtype, tolerance", REPRESENTABLE)
@pytest.mark.parametrize("tokens, top_k, num_experts, hidden, inter", SHAPES)
def test_16_bit_gpt_oss_equals_mxfp4_on_representable_weights(
    device, weight_dtype, dtype, tolerance, tokens, top_k, num_experts, hidden, inter
):
    x, packed, router, ids = call(GPT_OSS_MXFP4, tokens, top_k, num_experts, hidden, inter, dtype=dtype, device=device)
    w1, w2 = dequantize_experts(GPT_OSS_MXFP4, packed, hidden)
    assert torch.equal(w1.to(weight_dtype).float(), w1) and torch.equal(w2.to(weight_dtype).float(), w2)  # exact
    dense = poisoned({"w1": w1.to(weight_dtype), "w2": w2.to(weight_dtype), "w1_bias": packed["w1_bias"],
                      "w2_bias": packed["w2_bias"]}, "cpu")  # fmt: skip
    dense = {name: tensor.to(device) for name, tensor in dense.items()}
    for apply in (moe_apply_quant, moe_apply_quant_grouped):
        if apply is moe_apply_quant_grouped and dtype == torch.bfloat16 and not HAS_CUDA:
            continue  # the interpreter's bf16 products
        ours = apply(x, dense, router, ids, scheme=GPT_OSS_BF16, fp32_out=True)
        theirs = apply(x, packed, router, ids, scheme=GPT_OSS_MXFP4, fp32_out=True)
        check(ours, theirs, torch.float32, tolerance)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "weight_dtype, dtype",
    [
        pytest.param(torch.float32, torch.float16, id="fp32-weights-fp16-tokens"),
        pytest.param(torch.float32, torch.bfloat16, id="fp32-weights-bf16-tokens"),
        pytest.param(torch.bfloat16, torch.float16, id="bf16-weights-fp16-tokens"),
        pytest.param(torch.bfloat16, torch.float32, id="bf16-weights-fp32-tokens"),
    ],
)
def test_unquantized_weights_are_not_rounded_to_the_tokens_dtype(device, weight_dtype, dtype):
    """Weights of another dtype than ``hidden``'s multiply in fp32 (the grouped kernel would
    otherwise cast them to ``hidden``'s dtype): fp32 output within fp32 rounding of the reference."""
    scheme = unquantized(QuantScheme("mxfp4", gate_up="interleaved", activation="swiglu_oai", has_bias=True))
    assert scheme == GPT_OSS_BF16
    gen = torch.Generator().manual_seed(6)
    tensors = poisoned(quantize(scheme, float_experts(5, 40, 24, gen), weight_dtype), device)
    ids = random_topk(6, 3, 5, generator=gen).to(device)
    ids[2, 1] = -1
    x = torch.randn(6, 40, generator=gen).to(dtype).to(device)
    router = torch.rand(6, 3, generator=gen).to(device)
    reference = moe_apply_quant_torch(x.float(), tensors, router, ids, scheme=scheme)
    for apply in (moe_apply_quant, moe_apply_quant_grouped):
        check(apply(x, tensors, router, ids, scheme=scheme, fp32_out=True), reference, torch.float32, 1e-5)


def test_unquantized_scheme_registers_weights_and_biases_only():
    assert GPT_OSS_BF16.names == ("w1", "w2", "w1_bias", "w2_bias")
    assert unquantized(FP8_BLOCK_128) == QuantScheme("none")
    assert QuantScheme("none").names == ("w1", "w2")
    gen = torch.Generator().manual_seed(7)
    floats = float_experts(3, 32, 16, gen)
    tensors = quantize_experts(GPT_OSS_BF16, *floats, dtype=torch.bfloat16)
    assert tuple(tensors) == GPT_OSS_BF16.names and tensors["w1"].dtype == torch.bfloat16
    assert tensors["w1_bias"].dtype == torch.float32
    back1, back2 = dequantize_experts(GPT_OSS_BF16, tensors, hidden_size=32)
    assert torch.equal(back1, floats[0].bfloat16().float()) and torch.equal(back2, floats[1].bfloat16().float())
    with pytest.raises(ValueError, match="fp8_block"):
        QuantScheme("none", fp8_block=(128, 128))
    with pytest.raises(ValueError, match="dtype"):
        quantize_experts(GPT_OSS_MXFP4, *floats, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stores"):
        quantize_experts(QuantScheme("none"), *floats[:2], dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("device", devices())
def test_bad_inputs_raise(device):
    gen = torch.Generator().manual_seed(3)
    floats = float_experts(3, 32, 16, gen)
    fp8 = {name: t.to(device) for name, t in quantize_experts(FP8_BLOCK_128, *floats[:2]).items()}
    mxfp4 = {name: t.to(device) for name, t in quantize_experts(GPT_OSS_MXFP4, *floats).items()}
    x, router = torch.randn(2, 32, device=device), torch.rand(2, 2, device=device)
    ids = torch.zeros(2, 2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="lack"):
        moe_apply_quant(x, {k: v for k, v in mxfp4.items() if k != "w2_bias"}, router, ids, scheme=GPT_OSS_MXFP4)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        moe_apply_quant(x, {**fp8, "w1": fp8["w1"].float()}, router, ids, scheme=FP8_BLOCK_128)
    with pytest.raises(ValueError, match="w2_scale"):
        moe_apply_quant(x, {**fp8, "w2_scale": fp8["w2_scale"][:, :, :0]}, router, ids, scheme=FP8_BLOCK_128)
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        moe_apply_quant(torch.randn(2, 64, device=device), mxfp4, router, ids, scheme=GPT_OSS_MXFP4)
    with pytest.raises(TypeError, match="QuantScheme"):
        moe_apply_quant(x, fp8, router, ids, scheme="fp8")
    dense = {name: t.to(device) for name, t in quantize_experts(GPT_OSS_BF16, *floats).items()}
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        moe_apply_quant(x, {**dense, "w1": fp8["w1"]}, router, ids, scheme=GPT_OSS_BF16)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):  # H = 32 tokens, weights of H = 31
        moe_apply_quant_grouped(x, {**dense, "w1": dense["w1"][:, :, :31]}, router, ids, scheme=GPT_OSS_BF16)
    with pytest.raises(ValueError, match="lack"):
        moe_apply_quant(x, {"w1": dense["w1"], "w2": dense["w2"]}, router, ids, scheme=GPT_OSS_BF16)
    odd = QuantScheme("fp8", fp8_block=(8, 8))  # K steps of 8 columns: too small for tl.dot
    odd_tensors = {name: t.to(device) for name, t in quantize_experts(odd, *floats[:2]).items()}
    with pytest.raises(NotImplementedError, match="scale blocks"):
        moe_apply_quant_grouped(x, odd_tensors, router, ids, scheme=odd)
    tokens = QUANT_GROUPED_MIN_PAIRS[FORMAT_CODES["fp8"]] // 2  # "auto" would take the grouped GEMM: falls back
    many = torch.randint(0, 3, (tokens, 2), device=device)
    x_many, router_many = torch.randn(tokens, 32, device=device), torch.rand(tokens, 2, device=device)
    result = CachedWeightProvider(odd_tensors, cache_size=3, device=device).prepare(many)
    torch.testing.assert_close(moe_apply_quant_passes(x_many, [result], router_many, scheme=odd),
                               moe_apply_quant_torch(x_many, odd_tensors, router_many, many, scheme=odd))  # fmt: skip


# ---- GPU: model-sized shapes -------------------------------------------------------------

MODELS = [
    # Qwen3-30B-A3B-FP8 experts: H 2048, I 768, 128x128 blocks, top-8
    pytest.param(FP8_BLOCK_128, 2048, 768, 16, 8, id="qwen3-30b-fp8"),
    # GPT-OSS-20B: H = I = 2880, MXFP4 with biases, top-4
    pytest.param(GPT_OSS_MXFP4, 2880, 2880, 8, 4, id="gpt-oss-20b"),
    # GPT-OSS-20B in bf16 (tokens and weights): the tensor-core path of the unquantised format
    pytest.param(GPT_OSS_BF16, 2880, 2880, 8, 4, id="gpt-oss-20b-bf16"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme, hidden, inter, num_experts, top_k", MODELS)
@pytest.mark.parametrize("tokens", [1, 64])  # decode (GEMV) and a batch (grouped)
def test_model_shapes_on_gpu(scheme, hidden, inter, num_experts, top_k, tokens):
    gen = torch.Generator().manual_seed(4)
    tensors = quantize(scheme, [t.cuda() for t in float_experts(num_experts, hidden, inter, gen)], torch.bfloat16)
    ids = random_topk(tokens, top_k, num_experts, generator=gen).cuda()
    x = torch.randn(tokens, hidden, generator=gen).cuda().bfloat16()
    router = torch.rand(tokens, top_k, generator=gen).cuda()
    reference = moe_apply_quant_torch(x, tensors, router, ids, scheme=scheme)
    check(moe_apply_quant(x, tensors, router, ids, scheme=scheme), reference, torch.bfloat16, 2e-2)
    check(moe_apply_quant_grouped(x, tensors, router, ids, scheme=scheme), reference, torch.bfloat16, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "scheme", [FP8_BLOCK_128, GPT_OSS_MXFP4, GPT_OSS_BF16], ids=["fp8-block", "mxfp4", "none-gpt-oss"]
)
@pytest.mark.parametrize("tokens", [1, 64])  # GEMV and grouped
def test_captured_in_a_cuda_graph(scheme, tokens):
    """No host sync: a graph captures the call and replays it for new routing."""
    gen = torch.Generator().manual_seed(5)
    tensors = quantize(scheme, [t.cuda() for t in float_experts(16, 256, 128, gen)], torch.bfloat16)
    x = torch.randn(tokens, 256, generator=gen).cuda().bfloat16()
    router = torch.rand(tokens, 4, generator=gen).cuda()
    ids = random_topk(tokens, 4, 16, generator=gen).cuda()
    apply = moe_apply_quant if tokens == 1 else moe_apply_quant_grouped
    apply(x, tensors, router, ids, scheme=scheme)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = apply(x, tensors, router, ids, scheme=scheme)
    for _ in range(3):
        ids.copy_(random_topk(tokens, 4, 16, generator=gen).cuda())
        graph.replay()
        assert torch.equal(out, apply(x, tensors, router, ids, scheme=scheme))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8).cpu()
