"""Misuse of the store, layout, manifest, quantized formats and exponent coding: each input is
refused with a message saying what is allowed, and the objects keep working afterwards."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import random_weights

from expertcache.compression import encode
from expertcache.exponent_analysis import analyse
from expertcache.exponent_code import ExponentCode
from expertcache.exponent_decode import decode_records_torch
from expertcache.exponent_records import write_records
from expertcache.layout import layout_from_weights
from expertcache.manifest import Manifest
from expertcache.quant import FP8_PER_TENSOR, GPT_OSS_MXFP4, QuantScheme
from expertcache.quant_fp8 import quantize_fp8_blocks
from expertcache.quant_mxfp4 import dequantize_mxfp4, quantize_mxfp4
from expertcache.quant_tensors import quantize_experts
from expertcache.store import CPUBackingStore


def _weights(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return random_weights(4, 64, 32, dtype=dtype, generator=torch.Generator().manual_seed(0))


def _store(compression: str | None = None) -> tuple[CPUBackingStore, dict[str, torch.Tensor]]:
    weights = _weights(torch.bfloat16 if compression else torch.float32)
    return CPUBackingStore(layout_from_weights(weights)[1], weights, pin=False, compression=compression), weights


# -- CPUBackingStore -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: {**w, "w2": w["w2"][:1]}, "disagree on the number of experts"),  # copy_ broadcast one expert
        (lambda w: {**w, "w2": w["w2"].bfloat16()}, "but the layout holds"),  # copy_ cast the dtype
        (lambda w: {**w, "w2": w["w2"].transpose(1, 2)}, "disagree|but the layout holds"),  # another shape
        (lambda w: {**w, "bias": torch.zeros(4, 64)}, "but the layout holds"),  # a name the store would drop
        (lambda w: {"w1": w["w1"]}, r"lacks \['w2'\]"),  # was a bare KeyError
    ],
    ids=["one-expert-w2", "other-dtype", "other-shape", "extra-name", "missing-name"],
)
def test_store_refuses_weights_that_disagree_with_its_layout(change, message):
    weights = _weights()
    layout = layout_from_weights(weights)[1]
    with pytest.raises(ValueError, match=message):
        CPUBackingStore(layout, change(weights), pin=False)
    store = CPUBackingStore(layout, weights, pin=False)  # control: the matching weights are taken
    assert all(torch.equal(store.tensors[name], tensor) for name, tensor in weights.items())


def test_sparse_weights_are_refused_before_anything_is_built():
    weights = _weights()
    sparse = {**weights, "w1": weights["w1"].to_sparse()}
    with pytest.raises(TypeError, match=r"weights\['w1'\] must be a dense \(strided\) tensor"):
        layout_from_weights(sparse)
    with pytest.raises(TypeError, match="dense"):
        CPUBackingStore(layout_from_weights(weights)[1], sparse, pin=False)


@pytest.mark.parametrize("pin", ["no", 0, None])
def test_store_pin_must_be_a_bool(pin):
    weights = _weights()
    with pytest.raises(TypeError, match="pin must be True or False"):
        CPUBackingStore(layout_from_weights(weights)[1], weights, pin=pin)


def test_store_refuses_coding_settings_it_would_ignore():
    weights = _weights()
    layout = layout_from_weights(weights)[1]
    with pytest.raises(ValueError, match="encode_device applies with compression='exponent'"):
        CPUBackingStore(layout, weights, pin=False, encode_device="cpu")
    with pytest.raises(ValueError, match="progress=True applies with compression='exponent'"):
        CPUBackingStore(layout, weights, pin=False, progress=True)
    coded = _weights(torch.bfloat16)
    with pytest.raises(TypeError, match="progress must be True or False"):
        CPUBackingStore(layout_from_weights(coded)[1], coded, pin=False, compression="exponent", progress="no")
    CPUBackingStore(layout, weights, pin=False, progress=False)  # control: no bar asked, none shown


@pytest.mark.parametrize("compression", [None, "exponent"])
@pytest.mark.parametrize(
    "index, error, message",
    [
        (True, TypeError, "index must be an int"),  # a raw store returned [1, E, ...]
        (1.0, TypeError, "index must be an int"),
        (-1, ValueError, "index must be >= 0"),  # a raw store returned the last expert
        (4, ValueError, "index must be <= 3"),  # a coded store failed reshaping nothing
    ],
)
def test_store_expert_refuses_indices_outside_its_experts(compression, index, error, message):
    store, weights = _store(compression)
    with pytest.raises(error, match=message):
        store.expert("w1", index)
    expert = store.expert("w1", 3)  # control
    assert expert.shape == weights["w1"].shape[1:] and torch.equal(expert, weights["w1"][3])


@pytest.mark.parametrize("compression", [None, "exponent"])
def test_unknown_names_are_key_errors_naming_the_registered_ones(compression):
    """A coded store's mapping raised StopIteration, so ``in`` and ``get`` broke."""
    store, weights = _store(compression)
    assert "bias" not in store.tensors and store.tensors.get("bias") is None
    with pytest.raises(KeyError, match=r"'bias' is not a registered tensor; the store holds \['w1', 'w2'\]"):
        store.expert("bias", 0)
    assert torch.equal(store.tensors["w2"], weights["w2"])


# -- quantized formats -----------------------------------------------------------------------


def test_fp8_blocks_are_two_ints_not_bools():
    weight = torch.randn(2, 8, 64)
    with pytest.raises(ValueError, match=r"block must be two positive ints .* got \(True, 32\)"):
        quantize_fp8_blocks(weight, (True, 32))  # was a block of one row
    with pytest.raises(ValueError, match="block must be two positive ints"):
        quantize_fp8_blocks(weight, 32)  # was "object of type 'int' has no len()"
    with pytest.raises(ValueError, match="fp8_block must be two positive ints"):
        QuantScheme("fp8", fp8_block=(True, True))
    assert quantize_fp8_blocks(weight, (1, 32))[1].shape == (2, 8, 2)  # control


def test_scheme_has_bias_must_be_a_bool():
    with pytest.raises(TypeError, match="has_bias must be True or False"):
        QuantScheme("fp8", has_bias="no")  # a truthy string registered biases
    assert QuantScheme("fp8", has_bias=True).names[-2:] == ("w1_bias", "w2_bias")


@pytest.mark.parametrize(
    "columns, error, message",
    [
        (-1, ValueError, "columns must be >= 65"),  # dropped the last column
        (10, ValueError, "columns must be >= 65"),  # dropped whole groups
        (200, ValueError, "columns must be <= 96"),  # silently gave 96
        (True, TypeError, "columns must be an int"),
    ],
)
def test_mxfp4_columns_must_fall_in_the_last_group(columns, error, message):
    weight = torch.randn(2, 8, 80)
    blocks, scales = quantize_mxfp4(weight)  # 3 groups of 32: K in 65..96
    with pytest.raises(error, match=message):
        dequantize_mxfp4(blocks, scales, columns)
    assert dequantize_mxfp4(blocks, scales, 80).shape == weight.shape  # control


def test_quantize_experts_refuses_biases_of_the_wrong_shape():
    w1, w2 = torch.randn(3, 40, 64), torch.randn(3, 64, 20)
    with pytest.raises(ValueError, match=r"w1_bias must be \[3, 40\] .* got \[3, 20\]"):
        quantize_experts(GPT_OSS_MXFP4, w1, w2, torch.zeros(3, 20), torch.zeros(3, 64))
    with pytest.raises(ValueError, match=r"w2_bias must be \[3, 64\] .* got \[1, 64\]"):
        quantize_experts(GPT_OSS_MXFP4, w1, w2, torch.zeros(3, 40), torch.zeros(1, 64))
    out = quantize_experts(GPT_OSS_MXFP4, w1, w2, torch.zeros(3, 40), torch.zeros(3, 64))
    assert out["w1_bias"].shape == (3, 40) and tuple(out) == GPT_OSS_MXFP4.names
    assert tuple(quantize_experts(FP8_PER_TENSOR, w1, w2)) == FP8_PER_TENSOR.names


# -- exponent coding ---------------------------------------------------------------------------


def _coded() -> tuple[torch.Tensor, ExponentCode]:
    return torch.randn(3, 100, generator=torch.Generator().manual_seed(1)).bfloat16(), ExponentCode(
        torch.bfloat16, block=64
    )


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r.long(),  # was decoded as if it were bytes
        lambda r: torch.cat([r, r], dim=1),  # trailing bytes were ignored
        lambda r: r[:, :-16],
        lambda r: r[0],
    ],
    ids=["int64", "too-long", "too-short", "one-dimensional"],
)
def test_decoding_refuses_records_of_another_format(change):
    tensor, code = _coded()
    fmt, records = encode(tensor, code)
    with pytest.raises(ValueError, match=rf"records must be uint8 \[E, {fmt.record_bytes}\]"):
        decode_records_torch(change(records), fmt)
    assert torch.equal(decode_records_torch(records, fmt), tensor)  # control


def test_writing_records_refuses_a_tensor_other_than_the_analysed_one():
    tensor, code = _coded()
    analysis = analyse(tensor, code)
    out = torch.empty(3, analysis.format.record_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="the code is for torch.bfloat16, the tensor is torch.float16"):
        write_records(tensor.view(torch.float16), analysis, out)  # same bits: was coded as bf16
    with pytest.raises(ValueError, match="tensor has 3 experts of 50 values, the analysis 3 of 100"):
        write_records(tensor[:, :50], analysis, out)
    with pytest.raises(ValueError, match=r"out must be uint8 \[3, "):
        write_records(tensor, analysis, out[:2])
    write_records(tensor, analysis, out)  # control
    assert torch.equal(decode_records_torch(out, analysis.format), tensor)


def test_analysis_refuses_what_is_not_a_code_or_experts():
    tensor, code = _coded()
    with pytest.raises(TypeError, match="code must be an ExponentCode, got dtype"):
        analyse(tensor, torch.bfloat16)
    with pytest.raises(ValueError, match=r"must be \[E, \.\.\.\]; got a 0-d tensor"):
        analyse(tensor[0, 0], code)
    with pytest.raises(TypeError, match="dense"):
        encode(tensor.to_sparse(), code)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            analyse(tensor, code, device="cuda")
    assert analyse(tensor, code).format.values == 100  # control


# -- manifest ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["experts", "layers"])
def test_manifest_counts_have_an_upper_bound(tmp_path, field):
    from expertcache import CachedWeightProvider
    from expertcache.manifest import MAX_COUNT

    path = tmp_path / "manifest.json"
    CachedWeightProvider(_weights(), cache_size=2, device="cpu").manifest().write(path)
    good = json.loads(path.read_text())
    for value in (MAX_COUNT + 1, 10**400):
        path.write_text(json.dumps({**good, field: value}))
        with pytest.raises(ValueError, match=rf"'{field}' must be at most MAX_COUNT \(2,147,483,647\)"):
            Manifest.read(path)
    full = MAX_COUNT * good["expert_bytes"]  # the totals that follow the experts, as they would be
    totals = {"full_residency_gpu_bytes": full, "gpu_bytes_freed": full - good["pool_gpu_bytes"]}
    path.write_text(json.dumps({**good, "experts": MAX_COUNT, "layers": MAX_COUNT, **totals}))
    assert Manifest.read(path).experts == MAX_COUNT  # control: the bound itself is taken
