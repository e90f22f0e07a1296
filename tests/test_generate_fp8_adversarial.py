"""``expertcache generate`` on FP8 checkpoints whose weights and scales do not pair up, attacked
on the CPU, where transformers dequantizes FP8 as it loads.

transformers' dequantization takes each weight's blocks from the grid of the scale beside it
(not from config.json's ``weight_block_size``), loads an FP8 weight without a scale as it is and
multiplies a float weight beside a scale by it, all without a word in its load report. So:

Every refusal comes from the safetensors headers before any weight is read (on a GPU too).

1. FP8 weights without their ``weight_scale_inv`` are refused in one line, nothing on stdout:
   an expert projection's (it stayed float8 in the experts: a RuntimeError traceback mid-
   generation, exit status 1, with the model's lines on stdout; one layer's under the global
   budget was refused as "use budget 'per-layer'", which then gave that traceback; a checkpoint
   without any scale printed "FP8 values and scales ..., served packed" before its error), an
   attention projection's, a DeepSeek-V3 dense MLP's or shared expert's (their e4m3 values were
   the weights, unscaled: other tokens, exit status 0).
2. Scales off the grid of config.json's ``weight_block_size`` are refused: transposed or too few
   (transformers scaled other blocks than the checkpoint's: other tokens), a block size that
   disagrees with the scales (``[32, 32]``, ``[8, 8]``, none given: transformers' default
   ``[128, 128]``; the same command keeping FP8 packed on a GPU sizes the scales by it).
3. A scale beside a weight that is float already (bf16 experts, fp32 attention) is refused:
   transformers multiplied the weights by it again.
4. What is fine is not refused and generates transformers' own tokens: per-tensor scales
   (``weight_block_size`` null), bf16 or fp16 scales, ``activation_scheme: "static"`` with
   ``activation_scale`` tensors (transformers' dequantized model drops them), expert weights
   stored bf16 without scales, e5m2 values, a DeepSeek-V3 checkpoint with every linear FP8.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import HAS_CUDA
from test_generate_checkpoints import BLOCK, _transformers_tokens, write_fp8_checkpoint
from test_generate_mxfp4_adversarial import (
    _assert_refused,
    _checkpoint,
    _generate,
    weights_never_read,  # noqa: F401 - a fixture, used by name
)

from expertcache.quant_fp8 import dequantize_fp8_blocks, quantize_fp8_blocks

#: what transformers' CPU load does: on a GPU it keeps FP8 packed
cpu_load = pytest.mark.skipif(HAS_CUDA, reason="a CPU load: transformers dequantizes FP8 (on a GPU, packed)")
EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.\w+_proj\.weight$")
PAIR_UP = r"the FP8 weights and scales do not pair up as quantization_config\.weight_block_size "


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny FP8 checkpoint of each family (`write_fp8_checkpoint`), written once."""
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")
    written = {}
    for family in ("qwen3_moe", "deepseek_v3"):
        written[family] = tmp_path_factory.mktemp(f"fp8_{family}")
        write_fp8_checkpoint(written[family], family=family)
    return written


# -- checkpoint edits ---------------------------------------------------------------------------


def _drop_scales(pattern):
    """Drop the scale of every weight whose scale's name matches ``pattern``."""

    def edit(tensors):
        for key in [key for key in tensors if key.endswith(".weight_scale_inv") and re.search(pattern, key)]:
            tensors.pop(key)

    return edit


def _fp8_linears(pattern, *, scales=True):
    """Store every fp32 weight matching ``pattern`` as e4m3 on ``BLOCK``, with its scale or without."""

    def edit(tensors):
        for key in [key for key in tensors if re.search(pattern, key) and tensors[key].dtype == torch.float32]:
            tensors[key], scale = quantize_fp8_blocks(tensors[key], BLOCK)
            if scales:
                tensors[f"{key}_scale_inv"] = scale

    return edit


def _scales_beside_float(pattern):
    """Put a scale of 3 per ``BLOCK`` beside every fp32 weight matching ``pattern``, left fp32."""

    def edit(tensors):
        for key in [key for key in tensors if re.search(pattern, key)]:
            rows, columns = tensors[key].shape
            tensors[f"{key}_scale_inv"] = torch.full((-(-rows // BLOCK[0]), -(-columns // BLOCK[1])), 3.0)

    return edit


def _expert_weights(tensors):
    """The experts' float weights, dequantized from their e4m3 values and ``BLOCK`` scales."""
    keys = [key for key in tensors if EXPERT_WEIGHT.search(key)]
    return {key: dequantize_fp8_blocks(tensors[key], tensors[f"{key}_scale_inv"], BLOCK) for key in keys}


def _per_tensor(tensors):
    for key, weight in _expert_weights(tensors).items():
        tensors[key], scale = quantize_fp8_blocks(weight, tuple(weight.shape))
        tensors[f"{key}_scale_inv"] = scale.reshape(1)  # one per tensor: transformers' per-tensor layout


def _float_experts(*, keep_scales):
    """The experts stored bf16 (their dequantized weights), with their scales still beside or not."""

    def edit(tensors):
        for key, weight in _expert_weights(tensors).items():
            tensors[key] = weight.to(torch.bfloat16)
            if not keep_scales:
                tensors.pop(f"{key}_scale_inv")

    return edit


def _e5m2_values(tensors):
    for key in [key for key in tensors if EXPERT_WEIGHT.search(key)]:
        tensors[key] = tensors[key].float().to(torch.float8_e5m2)


def _scales(change, key=None):
    """``change`` applied to every scale, or to ``key`` alone."""

    def edit(tensors):
        for name in [name for name in tensors if name.endswith(".weight_scale_inv") and key in (None, name)]:
            tensors[name] = change(tensors[name])

    return edit


def _activation_scales(tensors):
    for key in [key for key in tensors if key.endswith(".weight_scale_inv")]:
        tensors[key.replace("weight_scale_inv", "activation_scale")] = torch.tensor([0.5])


def _both(first, second):
    """The checkpoint edit ``first`` then ``second``."""

    def edit(tensors):
        first(tensors)
        second(tensors)

    return edit


def _quantization(**fields):
    """Set (a value) or remove (``...``) fields of config.json's quantization_config."""

    def edit(values):
        for name, value in fields.items():
            if value is ...:
                values["quantization_config"].pop(name)
            else:
                values["quantization_config"][name] = value

    return edit


GATE_SCALE = "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"
ONE_LAYERS_DOWN = r"layers\.0\.mlp\.experts\.\d+\.down_proj"
NO_SCALE = "F8_E4M3 has no weight_scale_inv"


# -- 1-3. refused -------------------------------------------------------------------------------


REFUSED = [
    # was: a RuntimeError traceback from the experts mid-generation, exit status 1, stdout written
    pytest.param("qwen3_moe", {"state": _drop_scales(r"experts\.\d+\.down_proj")}, [],
                 rf"\(model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight {NO_SCALE}; .*; and 14 more\)",
                 id="expert-down-proj-without-scales"),
    # one layer's: was "use budget 'per-layer'" (global), then that traceback (per-layer)
    pytest.param("qwen3_moe", {"state": _drop_scales(ONE_LAYERS_DOWN)}, [],
                 rf"model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight {NO_SCALE}", id="one-layer-global"),
    pytest.param("qwen3_moe", {"state": _drop_scales(ONE_LAYERS_DOWN)}, ["--moe-expert-cache-budget", "per-layer"],
                 rf"model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight {NO_SCALE}", id="one-layer-per-layer"),
    # an activation's scale is not a weight's: not listed among the scales no weight reads
    pytest.param("qwen3_moe", {"state": _both(_activation_scales, _drop_scales(ONE_LAYERS_DOWN)),
                               "config": _quantization(activation_scheme="static")}, [],
                 rf"down_proj\.weight {NO_SCALE}; and 6 more\); transformers would", id="static-one-layer"),
    # was: "experts: FP8 values and scales ..., served packed" on stdout, then the error
    pytest.param("qwen3_moe", {"state": _drop_scales(".")}, [], rf"{NO_SCALE}; .*; and 46 more", id="no-scales"),
    # was: the e4m3 values loaded unscaled as the weights, exit status 0
    pytest.param("qwen3_moe", {"state": _fp8_linears(r"self_attn\.\w_proj\.weight$", scales=False)}, [],
                 rf"model\.layers\.0\.self_attn\.k_proj\.weight {NO_SCALE}", id="attention"),
    pytest.param("deepseek_v3", {"state": _fp8_linears(r"layers\.0\.mlp\.\w+_proj\.weight$", scales=False)}, [],
                 rf"model\.layers\.0\.mlp\.down_proj\.weight {NO_SCALE}", id="deepseek-dense-mlp"),
    pytest.param("deepseek_v3", {"state": _fp8_linears(r"shared_experts\.\w+_proj\.weight$", scales=False)}, [],
                 rf"model\.layers\.1\.mlp\.shared_experts\.down_proj\.weight {NO_SCALE}", id="deepseek-shared"),
    # was: transformers scaled blocks of 8x32 / 32x16 with them, exit status 0
    pytest.param("qwen3_moe", {"state": _scales(lambda scale: scale.t().contiguous())}, [],
                 r"\[16, 16\] says \(model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight_scale_inv is \[2, 4\], "
                 r"not \[4, 2\] for model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight \[64, 32\]",
                 id="scales-transposed"),
    pytest.param("qwen3_moe", {"state": _scales(lambda scale: scale[:1].contiguous(), GATE_SCALE)}, [],
                 r"gate_proj\.weight_scale_inv is \[1, 4\], not \[2, 4\] for .*gate_proj\.weight \[32, 64\]\)",
                 id="scales-too-few-blocks"),
    # was: accepted on the CPU, which reads the blocks off the scales (a GPU load sizes them by the config)
    pytest.param("qwen3_moe", {"config": _quantization(weight_block_size=[32, 32])}, [],
                 r"\[32, 32\] says \(.*down_proj\.weight_scale_inv is \[4, 2\], not \[2, 1\]", id="block-32"),
    pytest.param("qwen3_moe", {"config": _quantization(weight_block_size=[8, 8])}, [],
                 r"\[8, 8\] says \(.*down_proj\.weight_scale_inv is \[4, 2\], not \[8, 4\]", id="block-8"),
    pytest.param("qwen3_moe", {"config": _quantization(weight_block_size=...)}, [],
                 r"\[128, 128\] says \(.*down_proj\.weight_scale_inv is \[4, 2\], not \[1, 1\]", id="block-absent"),
    pytest.param("qwen3_moe", {"config": _quantization(weight_block_size=None)}, [],
                 r"None says \(.*down_proj\.weight_scale_inv is \[4, 2\], not \[1, 1\]", id="block-null"),
    # was: transformers multiplied the float weights by the scales, exit status 0
    pytest.param("qwen3_moe", {"state": _float_experts(keep_scales=True)}, [],
                 r"down_proj\.weight_scale_inv is beside a BF16 weight, not an FP8 one", id="bf16-experts-with-scales"),
    pytest.param("qwen3_moe", {"state": _scales_beside_float(r"self_attn\.\w_proj\.weight$")}, [],
                 r"self_attn\.k_proj\.weight_scale_inv is beside a F32 weight, not an FP8 one", id="fp32-attention"),
]  # fmt: skip


@pytest.mark.parametrize("family, edit, flags, match", REFUSED)
@pytest.mark.usefixtures("weights_never_read")  # refused from the safetensors headers
def test_fp8_weights_and_scales_that_do_not_pair_up_are_refused(bases, tmp_path, capfd, family, edit, flags, match):
    directory = _checkpoint(bases[family], tmp_path / "ckpt", **edit)
    before = sorted(path.name for path in directory.iterdir())
    status, out, err = _generate(directory, capfd, *flags)
    _assert_refused(status, out, err, PAIR_UP + ".*" + match)
    assert "transformers would load them mis-scaled" in err
    assert sorted(path.name for path in directory.iterdir()) == before  # nothing written


def _truncated(directory):
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[:100])


def _sharded_with_a_shard_missing(directory):
    (directory / "model.safetensors").rename(directory / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_not_json(directory):
    (directory / "model.safetensors").rename(directory / "model-00001-of-00001.safetensors")
    (directory / "model.safetensors.index.json").write_text("{not json")


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_truncated, r"cannot load the weights \(SafetensorError: .*\)$"),
        (_sharded_with_a_shard_missing, r"cannot load the weights \(FileNotFoundError: .*model-00002-of-00002"),
        (_index_not_json, r"cannot load the weights \(model\.safetensors\.index\.json is not a JSON object"),
    ],
    ids=["truncated", "shard-missing", "index-not-json"],
)
@pytest.mark.usefixtures("weights_never_read")
def test_fp8_headers_that_cannot_be_read_are_a_refused_load(bases, tmp_path, capfd, damage, match):
    """The FP8 check reads the headers before the load: a file it cannot read is refused as the
    load would be, in one line, before any weight is read."""
    directory = _checkpoint(bases["qwen3_moe"], tmp_path / "ckpt")
    damage(directory)
    _assert_refused(*_generate(directory, capfd), match)


@cpu_load
def test_transformers_loads_an_fp8_weight_without_its_scale_unscaled(bases, tmp_path):
    """Why the refusal: the load report is empty and the weight is the e4m3 values as they are."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    directory = _checkpoint(bases["qwen3_moe"], tmp_path / "ckpt",
                            state=_fp8_linears(r"self_attn\.q_proj\.weight$", scales=False))  # fmt: skip
    values = load_file(directory / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    model, loading = AutoModelForCausalLM.from_pretrained(directory, dtype="auto", output_loading_info=True)
    assert not any(loading.values())
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, values.float())


# -- 4. fine: transformers' own tokens ----------------------------------------------------------


ACCEPTED = [
    pytest.param("qwen3_moe", {"state": _per_tensor, "config": _quantization(weight_block_size=None)}, id="per-tensor"),
    pytest.param("qwen3_moe", {"state": _per_tensor, "config": _quantization(weight_block_size=...)},
                 id="per-tensor-default-block"),  # [128, 128] blocks of a [32, 64] weight: one, its scale
    pytest.param("qwen3_moe", {"state": _scales(lambda scale: scale.to(torch.bfloat16))}, id="bf16-scales"),
    pytest.param("qwen3_moe", {"state": _scales(lambda scale: scale.to(torch.float16))}, id="fp16-scales"),
    pytest.param("qwen3_moe", {"state": _activation_scales, "config": _quantization(activation_scheme="static")},
                 id="static-activation-scales"),
    pytest.param("qwen3_moe", {"state": _float_experts(keep_scales=False)}, id="bf16-experts-without-scales"),
    pytest.param("qwen3_moe", {"state": _e5m2_values}, id="e5m2-values"),
    pytest.param("deepseek_v3", {"state": _fp8_linears(r"(self_attn|mlp|shared_experts)\.\w+_proj\.weight$")},
                 id="deepseek-every-linear-fp8"),
]  # fmt: skip


@cpu_load
@pytest.mark.parametrize("family, edit", ACCEPTED)
def test_fine_fp8_checkpoints_generate_transformers_tokens(bases, tmp_path, capfd, family, edit):
    directory = _checkpoint(bases[family], tmp_path / "ckpt", **edit)
    expected = _transformers_tokens(directory)
    status, out, err = _generate(directory, capfd, "--compare")
    assert status == 0, err
    assert f"output token ids: {expected}" in out
    assert "without the cache: identical tokens" in out
