"""Bad input to the providers and the apply launchers, found by an adversarial pass over their
public entry points: each is refused with an error naming what is allowed, and changes nothing
(the providers' views are as before, and they keep serving)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import devices
from helpers import random_topk, random_weights, views

from expertcache import CachedWeightProvider, FullGPUProvider
from expertcache.kernels import (
    moe_apply,
    moe_apply_grouped,
    moe_apply_passes,
    moe_apply_quant,
    moe_apply_quant_grouped,
    moe_apply_torch,
    remap_topk_ids,
)
from expertcache.quant import QuantScheme
from expertcache.result import ExpertWeightResult

NUM_EXPERTS, HIDDEN, INTER = 6, 16, 8


def _call(device: str, tokens: int = 3, top_k: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [T, H], topk_weights [T, K], topk_ids [T, K])`` on ``device``."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    router = torch.rand(tokens, top_k, generator=gen)
    ids = random_topk(tokens, top_k, NUM_EXPERTS, generator=gen)
    return hidden.to(device), router.to(device), ids.to(device)


def _block_scaled_weights() -> dict[str, torch.Tensor]:
    """Weights with 128x128 block scales (one block a matrix at these sizes) far from 1."""
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER, generator=torch.Generator().manual_seed(1))
    weights["w1_scale"] = torch.full((NUM_EXPERTS, 1, 1), 3.0)
    weights["w2_scale"] = torch.full((NUM_EXPERTS, 1, 1), 0.5)
    return weights


# -- FullGPUProvider: ids outside the weights ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mapped", [False, True], ids=["no-map", "expert-map"])
@pytest.mark.parametrize("bad", [NUM_EXPERTS, -1, -7, 2**32 + 3], ids=["E", "minus-one", "negative", "wraps-to-3"])
def test_full_provider_refuses_host_ids_outside_the_experts(dtype, mapped, bad):
    """CPU ids (read without a sync) outside ``[0, E_global)`` went to the kernel unchecked, as
    a host-mode cache refuses them: an external fused-MoE kernel would index past ``w1``."""
    if bad > torch.iinfo(dtype).max:
        pytest.skip("not an int32 value")
    expert_map = torch.arange(NUM_EXPERTS, dtype=torch.int32).flip(0) if mapped else None
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER)
    provider = FullGPUProvider(weights, expert_map=expert_map)
    with pytest.raises(IndexError, match=rf"expert id {bad} in topk_ids is outside \[0, {NUM_EXPERTS}\)"):
        provider.prepare(torch.tensor([[0, bad], [1, 2]], dtype=dtype))
    good = torch.tensor([[0, NUM_EXPERTS - 1]], dtype=dtype)  # control: still a passthrough
    result = provider.prepare(good)
    assert result.w1 is weights["w1"]
    assert result.topk_ids is good if not mapped else result.topk_ids.tolist() == [[NUM_EXPERTS - 1, 0]]


def test_full_provider_with_a_wider_expert_map_checks_global_ids():
    expert_map = torch.tensor([-1, 0, -1, 1, -1, 2, 3, 4, 5, -1], dtype=torch.int32)  # 10 global, 6 local
    provider = FullGPUProvider(random_weights(NUM_EXPERTS, HIDDEN, INTER), expert_map=expert_map)
    assert provider.prepare(torch.tensor([[9, 3]])).topk_ids.tolist() == [[-1, 1]]  # another rank's: -1
    with pytest.raises(IndexError, match=r"expert id 10 in topk_ids is outside \[0, 10\)"):
        provider.prepare(torch.tensor([[10, 3]]))


# -- CachedWeightProvider's read-only views: an int, nothing else --------------------------------


@pytest.mark.parametrize("view", ["slot_of", "expert_in"])
@pytest.mark.parametrize("value", [True, 1.7, 1.0, "1", None], ids=["bool", "float", "whole-float", "str", "none"])
def test_views_take_an_int_not_something_int_accepts(view, value):
    """``int(1.7)`` is 1 and ``int("1")`` is 1: the views answered for another expert (or slot)
    than the caller named."""
    provider = CachedWeightProvider(random_weights(NUM_EXPERTS, HIDDEN, INTER), cache_size=2, device="cpu")
    provider.prepare(torch.tensor([[1, 0]]))
    before = views(provider)
    with pytest.raises(TypeError, match=f"{'expert_id' if view == 'slot_of' else 'slot'} must be an int"):
        getattr(provider, view)(value)
    assert views(provider) == before
    assert getattr(provider, view)(np.int64(1)) == getattr(provider, view)(1) >= 0  # control: numpy ints are ints


# -- the apply launchers: settings and weights they cannot honour --------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("apply", ["moe_apply", "moe_apply_grouped", "moe_apply_quant", "moe_apply_quant_grouped"])
def test_an_apply_refuses_a_truthy_non_bool_fp32_out(device, apply):
    """``fp32_out="no"`` returned fp32 (the string is truthy)."""
    hidden, router, ids = _call(device)
    weights = {name: t.to(device) for name, t in random_weights(NUM_EXPERTS, HIDDEN, INTER).items()}

    def run(fp32_out):
        if apply.startswith("moe_apply_quant"):
            quant = moe_apply_quant if apply == "moe_apply_quant" else moe_apply_quant_grouped
            return quant(hidden, weights, router, ids, scheme=QuantScheme("none"), fp32_out=fp32_out)
        return globals()[apply](hidden, weights["w1"], weights["w2"], router, ids, fp32_out=fp32_out)

    with pytest.raises(TypeError, match="fp32_out must be True or False, got 'no'"):
        run("no")
    assert run(False).dtype == torch.float32 and run(True).dtype == torch.float32  # control (fp32 hidden)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])
def test_passes_refuse_a_truthy_non_bool_fp32_out_before_the_first_pass(device, mode):
    provider = CachedWeightProvider(random_weights(NUM_EXPERTS, HIDDEN, INTER), cache_size=2, device=device, mode=mode)
    hidden, router, ids = _call(device)
    before = views(provider)
    with pytest.raises(TypeError, match="fp32_out must be True or False"):
        moe_apply_passes(hidden, provider.passes(ids), router, fp32_out="yes")
    assert views(provider) == before
    assert moe_apply_passes(hidden, provider.passes(ids), router).shape == hidden.shape  # control: still serves


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])
def test_grouped_passes_refuse_block_scales_they_would_ignore(device, mode):
    """``moe_apply_passes(kernel="grouped")`` over block-scaled weights ran the grouped GEMM,
    which has no scales: a wrong output, silently. It is refused before the first pass (as
    ``moe_apply_grouped`` refuses scales); ``kernel="gemv"`` computes it."""
    provider = CachedWeightProvider(_block_scaled_weights(), cache_size=2, device=device, mode=mode)
    hidden, router, ids = _call(device)
    before = views(provider)
    with pytest.raises(NotImplementedError, match="no block scales"):
        moe_apply_passes(hidden, provider.passes(ids), router, kernel="grouped")
    assert views(provider) == before
    full = {name: t.to(device) for name, t in _block_scaled_weights().items()}
    expected = moe_apply_torch(hidden, full["w1"], full["w2"], router, ids, w1_scale=full["w1_scale"],
                               w2_scale=full["w2_scale"])  # fmt: skip
    out = moe_apply_passes(hidden, provider.passes(ids), router, kernel="gemv")  # control: the scales applied
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", devices())
def test_grouped_passes_refuse_fp8_weights_as_the_grouped_apply_does(device):
    hidden, router, ids = _call(device)
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER)
    fp8 = {name: t.to(torch.float8_e4m3fn).to(device) for name, t in weights.items()}
    result = ExpertWeightResult(w1=fp8["w1"], w2=fp8["w2"], topk_ids=ids)
    with pytest.raises(NotImplementedError, match="fp32/fp16/bf16"):
        moe_apply_grouped(hidden, fp8["w1"], fp8["w2"], router, ids)
    with pytest.raises(NotImplementedError, match="fp32/fp16/bf16"):
        moe_apply_passes(hidden, [result], router, kernel="grouped")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8])
def test_moe_apply_refuses_integer_weights(device, dtype):
    """Integer weights (a quantised checkpoint without its scales) were multiplied as numbers."""
    hidden, router, ids = _call(device)
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER)
    w1, w2 = (weights[name].mul(64).to(dtype).to(device) for name in ("w1", "w2"))
    with pytest.raises(TypeError, match="w1 and w2 must be floating-point weights .*moe_apply_quant"):
        moe_apply(hidden, w1, w2, router, ids)
    with pytest.raises(TypeError, match="w1 and w2 must be floating-point weights"):
        moe_apply(hidden, weights["w1"].to(device), w2, router, ids)  # one of them is enough


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("block", [True, 128.0], ids=["bool", "float"])
def test_moe_apply_refuses_a_scale_block_that_is_not_an_int(device, block):
    """``scale_block=True`` was taken as blocks of one row and column."""
    hidden, router, ids = _call(device)
    weights = {name: t.to(device) for name, t in random_weights(NUM_EXPERTS, HIDDEN, INTER).items()}
    scales = {
        "w1_scale": torch.ones(NUM_EXPERTS, 2 * INTER, HIDDEN),
        "w2_scale": torch.ones(NUM_EXPERTS, HIDDEN, INTER),
    }
    scales = {name: t.to(device) for name, t in scales.items()}
    with pytest.raises(TypeError, match="scale_block must be a positive int"):
        moe_apply(hidden, weights["w1"], weights["w2"], router, ids, **scales, scale_block=block)
    out = moe_apply(hidden, weights["w1"], weights["w2"], router, ids, **scales, scale_block=1)  # control
    torch.testing.assert_close(out, moe_apply_torch(hidden, weights["w1"], weights["w2"], router, ids))


# -- remap_topk_ids --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, kind", [(torch.Tensor.to_sparse, "sparse_coo"), (torch.Tensor.to_sparse_csr, "sparse_csr")]
)
def test_remap_refuses_sparse_ids_by_name(make, kind):
    """A sparse ``topk_ids`` failed inside torch ("memory format option is only supported by strided tensors")."""
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(TypeError, match=f"topk_ids must be a dense .* got a {kind}"):
        remap_topk_ids(make(ids), torch.arange(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="mapping must be a dense"):
        remap_topk_ids(ids, torch.arange(4, dtype=torch.int32).to_sparse())  # a [E] table: COO
    assert remap_topk_ids(ids, torch.arange(4, dtype=torch.int32).flip(0)).tolist() == [[3, 2], [1, 0]]  # control
