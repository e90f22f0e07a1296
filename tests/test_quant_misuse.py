"""Misuse of the quantised expert formats and their apply: refused with a clear error, nothing changed.

1. Tensors a scheme does not register (biases with ``has_bias=False``, scales with format
   ``"none"``) are refused by the kernels, the reference and a cache's passes (they were
   dropped: a silently different MLP); a refused pass admits nothing.
2. The float reference `gated_moe_forward` refuses biases its scheme drops, asks for the ones
   it needs, and every reference refuses router weights of another shape than the ids
   (they were broadcast).
3. `dequant_experts_forward` (transformers' ``eager`` of MXFP4 experts) skips ids outside
   the experts as the kernels do (transformers' expert-parallel sentinel, -1), instead of
   an IndexError; it refuses a router of another shape.
4. `quantize_experts` refuses a scheme that is not a `QuantScheme`, weights that are not
   float tensors, shapes that disagree, non-finite weights (a quantised block became NaN or
   zero), and a ``dtype`` that is not one.
5. `dequantize_experts` refuses a ``hidden_size`` the weights do not have (it was ignored
   for fp8 and 16-bit weights) and missing tensors (a bare KeyError before).
6. A `QuantScheme` given ``fp8_block`` as a list equals, and hashes as, its tuple form.
7. The kernels refuse tokens of a dtype other than fp32, fp16 or bf16 (fp8 tokens gave fp8 output).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import devices

from expertcache import CachedWeightProvider
from expertcache.integrations.transformers.packed_models import Mxfp4Experts
from expertcache.integrations.transformers.quantized import dequant_experts_forward, quant_experts_forward
from expertcache.kernels import moe_apply_quant, moe_apply_quant_grouped, moe_apply_quant_passes, moe_apply_quant_torch
from expertcache.quant import GPT_OSS_BF16, GPT_OSS_MXFP4, QuantScheme
from expertcache.quant_tensors import dequantize_experts, quantize_experts
from expertcache.reference import gated_moe_forward

EXPERTS, HIDDEN, INTER = 3, 32, 16
BLOCK16 = QuantScheme("fp8", fp8_block=(16, 16))
MXFP4_NO_BIAS = QuantScheme("mxfp4", gate_up="interleaved", activation="swiglu_oai")  # GPT-OSS without biases


def floats(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5,
        torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5,
        torch.randn(EXPERTS, 2 * INTER, generator=gen),
        torch.randn(EXPERTS, HIDDEN, generator=gen),
    )


def call(device, tokens=2):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(device)
    ids = torch.randint(0, EXPERTS, (tokens, 2), generator=gen).to(device)
    return x, torch.rand(tokens, 2, generator=gen).to(device), ids


APPLIES = [moe_apply_quant, moe_apply_quant_grouped, moe_apply_quant_torch]


# -- 1. tensors the scheme does not register ---------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("apply", APPLIES, ids=lambda f: f.__name__)
def test_biases_the_scheme_does_not_register_are_refused(device, apply):
    tensors = {k: v.to(device) for k, v in quantize_experts(GPT_OSS_MXFP4, *floats()).items()}
    x, router, ids = call(device)
    with pytest.raises(ValueError, match=r"w1_bias.*has_bias"):
        apply(x, tensors, router, ids, scheme=MXFP4_NO_BIAS)


@pytest.mark.parametrize("device", devices())
def test_scales_given_with_unquantised_weights_are_refused(device):
    dense = quantize_experts(QuantScheme("none"), *floats()[:2])
    scales = quantize_experts(BLOCK16, *floats()[:2])
    tensors = {k: v.to(device) for k, v in {**dense, "w1_scale": scales["w1_scale"]}.items()}
    x, router, ids = call(device)
    for apply in APPLIES:
        with pytest.raises(ValueError, match="w1_scale"):
            apply(x, tensors, router, ids, scheme=QuantScheme("none"))


@pytest.mark.parametrize("device", devices())
def test_a_cache_pass_with_unregistered_biases_is_refused_before_admitting(device):
    tensors = quantize_experts(GPT_OSS_MXFP4, *floats())
    provider = CachedWeightProvider(tensors, cache_size=2, device=device)
    x, router, ids = call(device)
    with pytest.raises(ValueError, match="w1_bias"):
        moe_apply_quant_passes(x, provider.passes(ids), router, scheme=MXFP4_NO_BIAS)
    assert provider.resident() == frozenset() and provider.stats.misses == 0
    served = moe_apply_quant_passes(x, provider.passes(ids), router, scheme=GPT_OSS_MXFP4)  # still works
    reference = moe_apply_quant_torch(
        x, {k: v.to(device) for k, v in tensors.items()}, router, ids, scheme=GPT_OSS_MXFP4
    )
    torch.testing.assert_close(served, reference, atol=1e-5, rtol=1e-5)


# -- 2. the float reference -------------------------------------------------------------------


def test_gated_reference_refuses_biases_it_would_drop_and_asks_for_the_ones_it_needs():
    w1, w2, b1, b2 = floats()
    x, router, ids = call("cpu")
    with pytest.raises(ValueError, match="has_bias"):
        gated_moe_forward(x, w1, w2, router, ids, scheme=QuantScheme("none"), w1_bias=b1, w2_bias=b2)
    with pytest.raises(ValueError, match="w1_bias"):
        gated_moe_forward(x, w1, w2, router, ids, scheme=GPT_OSS_BF16)


def test_references_refuse_router_weights_of_another_shape():
    w1, w2, _, _ = floats()
    x, router, ids = call("cpu")
    tensors = quantize_experts(BLOCK16, w1, w2)
    with pytest.raises(ValueError, match="topk_weights"):
        moe_apply_quant_torch(x, tensors, router[:, :1], ids, scheme=BLOCK16)  # was broadcast over K
    with pytest.raises(ValueError, match="topk_weights"):
        gated_moe_forward(x, w1, w2, router[:, :1], ids, scheme=QuantScheme("none"))
    with pytest.raises(ValueError, match="hidden"):
        moe_apply_quant_torch(torch.randn(2, 2 * HIDDEN), tensors, router, ids, scheme=BLOCK16)


# -- 3. transformers' reference on MXFP4 experts ----------------------------------------------


def mxfp4_module():
    tensors = quantize_experts(GPT_OSS_MXFP4, *floats())
    names = {"gate_up_proj_blocks": "w1", "gate_up_proj_scales": "w1_scale", "gate_up_proj_bias": "w1_bias",
             "down_proj_blocks": "w2", "down_proj_scales": "w2_scale", "down_proj_bias": "w2_bias"}  # fmt: skip
    return Mxfp4Experts(SimpleNamespace(hidden_size=HIDDEN), {key: tensors[name] for key, name in names.items()})


@pytest.mark.parametrize("device", devices())
def test_dequant_forward_skips_ids_outside_the_experts_like_the_kernels(device):
    module = mxfp4_module().to(device)
    x, router, ids = call(device, tokens=3)
    ids[0, 1], ids[2, 0] = EXPERTS, -1  # transformers' expert-parallel sentinel; -1
    ours = dequant_experts_forward(module, x, ids, router)
    torch.testing.assert_close(ours, quant_experts_forward(module, x, ids, router), atol=1e-5, rtol=1e-5)


def test_dequant_forward_refuses_a_router_of_another_shape():
    module = mxfp4_module()
    x, router, ids = call("cpu")
    with pytest.raises(ValueError, match="topk_weights"):
        dequant_experts_forward(module, x, ids, router[:, :1])


# -- 4. quantize_experts ----------------------------------------------------------------------


def test_quantize_experts_refuses_shapes_that_disagree():
    w1, w2, _, _ = floats()
    for bad_w1, bad_w2 in [(w1, w2[:2]), (w1, w2[:, :8]), (w1[:, :31], w2), (w1[0], w2[0]), (w1, w2[..., :8])]:
        with pytest.raises(ValueError, match=r"w1 .*w2|w1 and w2"):
            quantize_experts(BLOCK16, bad_w1, bad_w2)


@pytest.mark.parametrize(
    "scheme", [BLOCK16, QuantScheme("fp8"), QuantScheme("mxfp4")], ids=["fp8-block", "fp8-tensor", "mxfp4"]
)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_quantize_experts_refuses_non_finite_weights(scheme, bad):
    w1, w2, _, _ = floats()
    w1[1, 3, 5] = bad  # fp8: the block's scale became inf or NaN, its other values 0 or NaN
    with pytest.raises(ValueError, match="w1 .*finite"):
        quantize_experts(scheme, w1, w2)


def test_quantize_experts_refuses_what_is_not_a_scheme_a_float_tensor_or_a_dtype():
    w1, w2, b1, b2 = floats()
    with pytest.raises(TypeError, match="scheme"):
        quantize_experts("fp8", w1, w2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="w1"):
        quantize_experts(BLOCK16, w1.tolist(), w2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="w2"):
        quantize_experts(BLOCK16, w1, (w2 * 64).to(torch.int32))
    with pytest.raises(TypeError, match="w1_bias"):
        quantize_experts(GPT_OSS_MXFP4, w1, w2, b1.tolist(), b2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        quantize_experts(QuantScheme("none"), w1, w2, dtype="bf16")  # type: ignore[arg-type]


# -- 5. dequantize_experts --------------------------------------------------------------------


@pytest.mark.parametrize(
    "scheme", [BLOCK16, QuantScheme("fp8"), QuantScheme("none")], ids=["fp8-block", "fp8-tensor", "none"]
)
def test_dequantize_experts_refuses_a_hidden_size_the_weights_do_not_have(scheme):
    tensors = quantize_experts(scheme, *floats()[:2])
    for bad in (HIDDEN + 1, True, 32.0):
        with pytest.raises((ValueError, TypeError), match="hidden_size"):
            dequantize_experts(scheme, tensors, bad)  # type: ignore[arg-type]


def test_dequantize_experts_names_missing_tensors():
    tensors = quantize_experts(BLOCK16, *floats()[:2])
    with pytest.raises(ValueError, match="w1_scale"):
        dequantize_experts(BLOCK16, {"w1": tensors["w1"], "w2": tensors["w2"]}, HIDDEN)


# -- 6. QuantScheme ---------------------------------------------------------------------------


def test_a_list_fp8_block_is_the_tuple_one():
    scheme = QuantScheme("fp8", fp8_block=[16, 16])  # type: ignore[arg-type]
    assert scheme == BLOCK16 and hash(scheme) == hash(BLOCK16)


# -- 7. tokens' dtype -------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("apply", APPLIES[:2], ids=lambda f: f.__name__)
def test_kernels_refuse_tokens_of_another_dtype(device, apply):
    tensors = {k: v.to(device) for k, v in quantize_experts(BLOCK16, *floats()[:2]).items()}
    x, router, ids = call(device)
    with pytest.raises(TypeError, match="hidden"):
        apply(x.to(torch.float8_e4m3fn), tensors, router, ids, scheme=BLOCK16)
