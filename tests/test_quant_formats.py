"""The packed formats: round trips, exactness on representable values, and agreement with
transformers' own dequantisation and GPT-OSS's expert forward (pure torch, no kernels)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from helpers import random_topk

from expertcache.quant import FP8_BLOCK_128, FP8_PER_TENSOR, GPT_OSS_MXFP4, QuantScheme
from expertcache.quant_fp8 import (
    FP8_MAX,
    dequantize_fp8_blocks,
    dequantize_fp8_per_tensor,
    quantize_fp8_blocks,
    quantize_fp8_per_tensor,
)
from expertcache.quant_mxfp4 import E2M1_VALUES, dequantize_mxfp4, mxfp4_groups, quantize_mxfp4
from expertcache.quant_tensors import dequantize_experts, quantize_experts
from expertcache.reference import gated_moe_forward, moe_forward, quant_moe_forward


def _transformers(module: str):
    try:
        return importlib.import_module(f"transformers.{module}")
    except Exception as error:  # noqa: BLE001 - any failure to import means: skip
        pytest.skip(f"transformers.{module} is not importable here: {error}")


# ---- fp8 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, block",
    [
        ((2, 300, 200), (128, 128)),  # ragged last row and column blocks (DeepSeek's block)
        ((3, 48, 40), (16, 16)),  # several small blocks, ragged columns
        ((1, 7, 5), (128, 128)),  # smaller than one block
        ((2, 33, 64), (8, 32)),  # rectangular blocks
    ],
)
def test_fp8_block_round_trip_is_within_e4m3_precision(shape, block):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
    quantized, scale = quantize_fp8_blocks(weight, block)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == weight.shape
    assert scale.dtype == torch.float32
    assert scale.shape == (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    back = dequantize_fp8_blocks(quantized, scale, block)
    # 3 mantissa bits: half a step is 2**-4 of the value; subnormals step 2**-9 of the scale
    full_scale = scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., : shape[-2], : shape[-1]]
    bound = torch.maximum(weight.abs() * 2**-4, full_scale * 2**-10) * 1.0001
    assert ((back - weight).abs() <= bound).all()
    assert quantized.float().abs().max() <= FP8_MAX


def test_fp8_blocks_are_exact_on_representable_values():
    """fp8 values times a power-of-two block scale, each block reaching 448: bit-exact."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (2, 40, 24), dtype=torch.uint8, generator=gen)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN
    values = codes.view(torch.float8_e4m3fn).float()
    values[:, ::16, ::8] = FP8_MAX  # every (16, 8) block holds the largest value
    exponents = torch.randint(-12, 4, (2, 3, 3), generator=gen).float()
    scale = torch.exp2(exponents)
    weight = dequantize_fp8_blocks(values.to(torch.float8_e4m3fn), scale, (16, 8))
    quantized, scale_back = quantize_fp8_blocks(weight, (16, 8))
    assert torch.equal(scale_back, scale)
    assert torch.equal(quantized.float(), values)


def test_fp8_per_tensor_has_one_scale_per_matrix():
    weight = torch.randn(4, 10, 6, generator=torch.Generator().manual_seed(2))
    weight[1] *= 100  # one expert far larger: its own scale
    quantized, scale = quantize_fp8_per_tensor(weight)
    assert scale.shape == (4,)
    torch.testing.assert_close(scale, weight.abs().amax(dim=(1, 2)) / FP8_MAX)
    back = dequantize_fp8_per_tensor(quantized, scale)
    assert ((back - weight).abs() <= torch.maximum(weight.abs() * 2**-4, scale[:, None, None] * 2**-10) * 1.0001).all()


def test_fp8_zero_blocks_get_scale_one():
    weight = torch.zeros(1, 20, 20)
    weight[0, :10, :10] = 1.0
    quantized, scale = quantize_fp8_blocks(weight, (10, 10))
    assert torch.equal(scale, torch.tensor([[[1.0 / FP8_MAX, 1.0], [1.0, 1.0]]]))
    assert torch.equal(dequantize_fp8_blocks(quantized, scale, (10, 10)), weight)


def test_fp8_dequantisation_matches_transformers():
    fp8 = _transformers("integrations.finegrained_fp8")
    dequantize = getattr(fp8, "_dequantize_fp8_weight", None)
    if dequantize is None:
        pytest.skip("this transformers has no finegrained_fp8._dequantize_fp8_weight")
    weight = torch.randn(3, 300, 200, generator=torch.Generator().manual_seed(3))
    quantized, scale = quantize_fp8_blocks(weight, (128, 128))
    theirs = dequantize(quantized, scale, [128, 128], torch.float32)
    assert torch.equal(dequantize_fp8_blocks(quantized, scale, (128, 128)), theirs)


# ---- mxfp4 -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        (2, 10, 64),  # whole groups
        (3, 7, 45),  # a ragged last group (padded with zeros)
        (1, 1, 1),  # one value
    ],
)
def test_mxfp4_round_trip_is_within_e2m1_precision(shape):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(4)) * 0.02
    blocks, scales = quantize_mxfp4(weight)
    groups = mxfp4_groups(shape[-1])
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (*shape[:-1], groups, 16) and scales.shape == (*shape[:-1], groups)
    back = dequantize_mxfp4(blocks, scales, shape[-1])
    # grid 0, .5, 1, 1.5, 2, 3, 4, 6: half a step is at most a quarter of the scale or of the value
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)[..., : shape[-1]]
    assert ((back - weight).abs() <= torch.maximum(weight.abs(), scale) * 0.25 * 1.0001).all()
    assert (back.abs() <= 6 * scale).all()  # the scale is chosen so that nothing clips
    padding = dequantize_mxfp4(blocks, scales)[..., shape[-1] :]
    assert (padding == 0).all()


def test_mxfp4_is_exact_on_representable_values_and_nibble_order():
    """Codes and scales quantised from their own dequantisation come back bit for bit."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (3, 5, 4, 32), generator=gen)
    codes[..., 7] = 7  # every group reaches 6: its scale is the one it came from
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    scales = torch.randint(100, 140, (3, 5, 4), dtype=torch.uint8, generator=gen)
    weight = dequantize_mxfp4(blocks, scales)
    expected = torch.tensor(E2M1_VALUES)[codes] * torch.exp2(scales.float() - 127)[..., None]
    assert torch.equal(weight, expected.flatten(-2))  # low nibble = even column
    blocks_back, scales_back = quantize_mxfp4(weight)
    assert torch.equal(scales_back, scales)
    assert torch.equal(blocks_back, blocks)


def test_mxfp4_rounds_ties_to_even_codes():
    scaled = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 6.0])
    weight = torch.zeros(1, 32)
    weight[0, : scaled.numel()] = scaled
    blocks, scales = quantize_mxfp4(weight)
    assert scales.item() == 127  # max 6: scale 1
    back = dequantize_mxfp4(blocks, scales)[0, : scaled.numel()]
    assert back.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0]


def test_mxfp4_dequantisation_matches_transformers():
    mxfp4 = _transformers("integrations.mxfp4")
    weight = torch.randn(4, 24, 96, generator=torch.Generator().manual_seed(6)) * 0.03
    blocks, scales = quantize_mxfp4(weight)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]: x @ W
    assert torch.equal(theirs.transpose(1, 2), dequantize_mxfp4(blocks, scales))


def test_gpt_oss_mlp_matches_transformers_experts():
    """Interleaved gate/up rows, clamped SwiGLU and biases as GptOssExperts computes them,
    its weights dequantised by transformers from our packed tensors."""
    mxfp4 = _transformers("integrations.mxfp4")
    modeling = _transformers("models.gpt_oss.modeling_gpt_oss")
    config = _transformers("models.gpt_oss.configuration_gpt_oss").GptOssConfig(
        hidden_size=64, intermediate_size=32, num_local_experts=5, num_experts_per_tok=2
    )
    gen = torch.Generator().manual_seed(7)
    experts, hidden, inter = 5, 64, 32
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3  # large enough to reach the clamp
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    tensors = quantize_experts(GPT_OSS_MXFP4, w1, w2, torch.randn(experts, 2 * inter, generator=gen),
                               torch.randn(experts, hidden, generator=gen))  # fmt: skip
    module = modeling.GptOssExperts(config)
    with torch.no_grad():
        module.gate_up_proj.copy_(
            mxfp4.convert_moe_packed_tensors(tensors["w1"], tensors["w1_scale"], dtype=torch.float32)
        )
        module.down_proj.copy_(
            mxfp4.convert_moe_packed_tensors(tensors["w2"], tensors["w2_scale"], dtype=torch.float32)
        )
        module.gate_up_proj_bias.copy_(tensors["w1_bias"])
        module.down_proj_bias.copy_(tensors["w2_bias"])
    x = torch.randn(6, hidden, generator=gen) * 2
    ids = random_topk(6, 2, experts, generator=gen)
    router = torch.rand(6, 2, generator=gen)
    with torch.no_grad():
        theirs = modeling.GptOssExperts.forward(module, x, ids, router)
    ours = quant_moe_forward(x, tensors, router, ids, scheme=GPT_OSS_MXFP4)
    h = x @ dequantize_mxfp4(tensors["w1"], tensors["w1_scale"])[ids[0, 0]].T + tensors["w1_bias"][ids[0, 0]]
    assert (h[:, 0::2] > GPT_OSS_MXFP4.limit).any() or (h[:, 1::2].abs() > GPT_OSS_MXFP4.limit).any()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-5)


# ---- schemes ---------------------------------------------------------------------------


def test_silu_concatenated_scheme_is_the_project_reference():
    gen = torch.Generator().manual_seed(8)
    w1, w2 = torch.randn(4, 12, 8, generator=gen), torch.randn(4, 8, 6, generator=gen)
    x, ids, router = torch.randn(3, 8, generator=gen), random_topk(3, 2, 4, generator=gen), torch.rand(3, 2)
    ids[1, 1] = -1
    ours = gated_moe_forward(x, w1, w2, router, ids, scheme=FP8_BLOCK_128)
    assert torch.equal(ours, moe_forward(x, w1, w2, router, ids))


@pytest.mark.parametrize(
    "scheme", [FP8_BLOCK_128, FP8_PER_TENSOR, GPT_OSS_MXFP4], ids=["fp8-block", "fp8-tensor", "mxfp4"]
)
def test_quantize_experts_registers_the_scheme_names(scheme):
    gen = torch.Generator().manual_seed(9)
    w1, w2 = torch.randn(3, 2 * 20, 36, generator=gen), torch.randn(3, 36, 20, generator=gen)
    biases = (torch.zeros(3, 40), torch.zeros(3, 36)) if scheme.has_bias else ()
    tensors = quantize_experts(scheme, w1, w2, *biases)
    assert tuple(tensors) == scheme.names
    assert all(t.shape[0] == 3 and t.is_contiguous() for t in tensors.values())
    back1, back2 = dequantize_experts(scheme, tensors, hidden_size=36)
    assert back1.shape == w1.shape and back2.shape == w2.shape
    torch.testing.assert_close(back1, w1, atol=0.6, rtol=0.3)  # coarse: any of the formats


def test_scheme_rejects_nonsense():
    with pytest.raises(ValueError, match="format"):
        QuantScheme("int4")
    with pytest.raises(ValueError, match="fp8_block"):
        QuantScheme("mxfp4", fp8_block=(128, 128))
    with pytest.raises(ValueError, match="gate_up"):
        QuantScheme("fp8", gate_up="stacked")
    with pytest.raises(ValueError, match="biases"):
        quantize_experts(GPT_OSS_MXFP4, torch.zeros(1, 4, 32), torch.zeros(1, 32, 2))
    with pytest.raises(ValueError, match=r"registers no biases \(has_bias=False\): they would be dropped"):
        quantize_experts(FP8_BLOCK_128, torch.zeros(1, 4, 32), torch.zeros(1, 32, 2), torch.zeros(1, 4), None)
    for bad, error in (("7", TypeError), (True, TypeError), (float("nan"), ValueError), (0.0, ValueError)):
        with pytest.raises(error, match="limit must be"):
            QuantScheme("mxfp4", activation="swiglu_oai", limit=bad)
    with pytest.raises(ValueError, match="'silu' has none"):  # it would be ignored
        QuantScheme("fp8", alpha=1.0)
    assert QuantScheme("none", activation="swiglu_oai", alpha=np.float32(1.5), limit=3).limit == 3
