"""``expertcache generate`` on checkpoints whose config or expert tensors do not say what the
model will compute, and on FP8 checkpoints.

1. A ``quant_method`` transformers does not know (``"MXFP4"``, ``"Mxfp4"``, ``"fp4"``) is
   refused in one line before any weight is read, with the spelling transformers knows when
   it is one; transformers had skipped the quantization with a warning and the command then
   refused "no weights for 4 of the model's parameters" without saying why.
2. Expert tensors the model does not use are refused in one line: transformers drops them
   with a report and computes the experts without them, so the cache served other weights
   than the checkpoint's (a bias for experts without biases generated other tokens; FP8
   scales under other names than transformers reads left e4m3 values unscaled, a traceback).
3. FP8 checkpoints in the hub's layout (one weight and one ``weight_scale_inv`` per expert and
   projection) generate transformers' own tokens; packed experts compute with the project's
   kernels unless ``--experts-implementation`` names another (transformers' FP8 functions need
   the hub's finegrained-fp8 kernel, which does not load offline), and the command says so.
   transformers dequantizes FP8 without a GPU and needs ``accelerate`` to load FP8 at all: the
   CPU tests dequantize, the GPU test serves the e4m3 bytes.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import HAS_CUDA
from test_generate_mxfp4_adversarial import (
    PROMPT,
    _assert_refused,
    _checkpoint,
    _generate,
    weights_never_read,  # noqa: F401 - a fixture, used by name
)
from test_transformers_quantized import SIZES, write_mxfp4_checkpoint

from expertcache.integrations.transformers.generation import greedy_generate
from expertcache.integrations.transformers.quantized import QUANT_IMPLEMENTATION
from expertcache.integrations.transformers.random_models import random_model
from expertcache.quant_fp8 import quantize_fp8_blocks

BLOCK = (16, 16)  # the scale block of the tiny FP8 checkpoints: H = 64 and I = 32 are whole blocks
EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mxfp4")
    write_mxfp4_checkpoint(directory)
    return directory


# -- 1. quant_method spellings ------------------------------------------------------------


@pytest.mark.parametrize(
    "method, hint",
    [
        ("MXFP4", "did you mean 'mxfp4'"),  # capitals: transformers' names are lower case
        ("Mxfp4", "did you mean 'mxfp4'"),
        ("mxfp4 ", "did you mean 'mxfp4'"),  # a trailing space
        ("fp4", "known: .*mxfp4"),  # no near spelling: the known ones are listed
        (5, "known: aqlm, "),  # not a string: shown as '5'
    ],
)
@pytest.mark.usefixtures("weights_never_read")
def test_an_unknown_quant_method_is_refused_before_the_weights(mxfp4_checkpoint, tmp_path, capfd, method, hint):
    def spelled(config):
        config["quantization_config"] = {"quant_method": method}

    directory = _checkpoint(mxfp4_checkpoint, tmp_path, config=spelled)
    _assert_refused(*_generate(directory, capfd), rf"quant_method .* is not one transformers knows.*{hint}")


# -- 2. expert tensors the model does not use ---------------------------------------------


def _float_checkpoint(directory, family="qwen3_moe", dtype=torch.float32):
    random_model(family, SIZES, dtype=dtype).save_pretrained(directory)
    return directory


def test_an_expert_bias_the_model_does_not_have_is_refused(tmp_path, capfd):
    """Qwen3-MoE experts have no biases: a checkpoint holding one computed without it."""
    from safetensors.torch import load_file, save_file

    directory = _float_checkpoint(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.1.mlp.experts.gate_up_proj_bias"] = torch.ones(8, 2 * SIZES.intermediate)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    _assert_refused(
        *_generate(directory, capfd),
        r"holds 1 expert tensors the model does not use \(model\.layers\.1\.mlp\.experts\.gate_up_proj_bias\); "
        r"transformers would compute the experts without them",
    )


def test_a_tensor_beside_the_experts_is_not_an_expert_tensor(tmp_path, capfd):
    """An unused tensor outside the experts modules is transformers' to report, not refused."""
    from safetensors.torch import load_file, save_file

    directory = _float_checkpoint(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.1.mlp.unused_extra"] = torch.ones(3)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    status, out, err = _generate(directory, capfd)
    assert status == 0, err
    assert "output token ids:" in out


# -- 3. FP8 checkpoints -------------------------------------------------------------------


def write_fp8_checkpoint(directory, *, family="qwen3_moe", scale_names="hub") -> None:
    """A tiny FP8 checkpoint as the hub has them: e4m3 ``experts.{e}.{gate,up,down}_proj.weight``
    and fp32 ``...weight_scale_inv`` (one per ``BLOCK``) per expert, every other tensor float.

    ``scale_names="fused"`` writes the scales as ``experts.{gate_up,down}_proj_scale_inv``
    instead (names transformers does not read for this layout)."""
    import json

    from safetensors.torch import load_file, save_file

    _float_checkpoint(directory, family)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    fused = [key for key in tensors if EXPERTS.match(key)]
    for key in fused:  # a checkpoint of transformers' fused layout: split into the hub's
        prefix, proj = EXPERTS.match(key).groups()
        weight = tensors.pop(key)
        halves = {"gate_proj": weight[:, : weight.shape[1] // 2], "up_proj": weight[:, weight.shape[1] // 2 :]}
        for name, part in (halves if proj == "gate_up_proj" else {"down_proj": weight}).items():
            for expert in range(part.shape[0]):
                tensors[f"{prefix}.{expert}.{name}.weight"] = part[expert].contiguous()
    scales: dict[str, list[torch.Tensor]] = {}
    for key in [key for key in tensors if re.search(r"\.experts\.\d+\.\w+_proj\.weight$", key)]:
        values, scale = quantize_fp8_blocks(tensors[key], BLOCK)
        tensors[key] = values
        if scale_names == "hub":
            tensors[f"{key}_scale_inv"] = scale
        else:
            prefix, proj = re.match(r"^(.*\.experts)\.\d+\.(\w+_proj)\.weight$", key).groups()
            scales.setdefault(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}_scale_inv", [])
            scales[f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}_scale_inv"].append(scale)
    for key, parts in scales.items():
        tensors[key] = torch.stack(parts)
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))


def _transformers_tokens(directory, device="cpu") -> list[int]:
    """transformers' own greedy tokens for ``PROMPT`` from the checkpoint (FP8 dequantized on
    a CPU: what it does there)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto").to(device).eval()
    tokens = torch.tensor([PROMPT], device=device)
    return greedy_generate(model, tokens, 4).tokens[0, len(PROMPT) :].tolist()


@pytest.mark.skipif(HAS_CUDA, reason="transformers keeps FP8 packed on a GPU: the gpu test below")
def test_an_fp8_checkpoint_generates_transformers_tokens(tmp_path, capfd):
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")
    write_fp8_checkpoint(tmp_path)
    expected = _transformers_tokens(tmp_path)
    status, out, err = _generate(tmp_path, capfd, "--compare")
    assert status == 0, err
    assert f"output token ids: {expected}" in out
    assert "without the cache: identical tokens" in out
    assert "served packed" not in out  # dequantized by transformers without a GPU: float experts


@pytest.mark.usefixtures("weights_never_read")
def test_fp8_scales_under_names_transformers_does_not_read_are_refused(tmp_path, capfd):
    """Without a GPU transformers dequantizes with the hub layout's scales; fused ones were
    dropped with a report and the e4m3 values computed unscaled (a RuntimeError traceback
    from the experts implementation). Refused from the headers, before any weight is read,
    naming the weights without scales and the scales that no weight reads."""
    write_fp8_checkpoint(tmp_path, scale_names="fused")
    _assert_refused(
        *_generate(tmp_path, capfd),
        r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight F8_E4M3 has no weight_scale_inv; and 46 more; "
        r"scales beside no FP8 weight: model\.layers\.0\.mlp\.experts\.down_proj_scale_inv, "
        r"model\.layers\.0\.mlp\.experts\.gate_up_proj_scale_inv, and 2 more\)",
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_an_fp8_checkpoint_is_served_packed_with_the_projects_kernels(tmp_path, capfd):
    """On a GPU transformers keeps the e4m3 experts; with no implementation named they compute
    with the project's kernels (transformers' FP8 functions need the hub's kernel: offline, the
    command stopped there) and equal the uncached model computing the same way. The tiny
    checkpoint's attention is float: config.json says so (``modules_to_not_convert``), else
    transformers' GPU load expects FP8 attention with scales and the command refuses the
    checkpoint as missing them."""
    import json

    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")
    write_fp8_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "q_proj", "k_proj", "v_proj", "o_proj"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    status, out, err = _generate(tmp_path, capfd, "--compare", device="cuda")
    assert status == 0, err
    assert f"experts: FP8 values and scales of {SIZES.num_moe_layers} MoE layers, served packed" in out
    assert f"experts computed with {QUANT_IMPLEMENTATION} (--experts-implementation names another)" in out
    assert "without the cache: identical tokens" in out


def test_mxfp4_experts_compute_with_the_projects_kernels_by_default(mxfp4_checkpoint, capfd):
    """Packed MXFP4 experts with no implementation named: the project's kernels, said so, the
    uncached model's tokens (`Mxfp4Experts`' own default dequantized every call in torch)."""
    status, out, err = _generate(mxfp4_checkpoint, capfd, "--compare")
    assert status == 0, err
    assert f"experts computed with {QUANT_IMPLEMENTATION} (--experts-implementation names another)" in out
    assert "without the cache: identical tokens" in out


def test_a_named_implementation_is_kept_and_not_announced(mxfp4_checkpoint, capfd):
    status, out, err = _generate(mxfp4_checkpoint, capfd, "--experts-implementation", "eager")
    assert status == 0, err
    assert "experts computed with" not in out
