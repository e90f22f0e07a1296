"""Quantized checkpoints served packed: FP8 Qwen3-MoE / DeepSeek-V3 and MXFP4 GPT-OSS.

Nothing is downloaded. FP8: transformers' ``from_pretrained`` cannot load an FP8 checkpoint
packed on a CPU (its quantizer dequantizes without a GPU, and needs ``accelerate``), so the
FP8 blocks are built as transformers builds them (``replace_with_fp8_linear``) and filled
with random weights quantized to the checkpoint format; transformers' own load-time
dequantization (``Fp8Dequantize``) gives the float model they must match. transformers' FP8
experts functions call the hub's finegrained-fp8 kernel, which is replaced here by a
dequantizing stand-in so that transformers' own code runs on the slots. MXFP4: a GPT-OSS
checkpoint is written to a folder and loaded with ``Mxfp4Config(dequantize=True)``
(transformers' dequantization: the reference) and once more with `load_mxfp4_experts`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from conftest import HAS_CUDA
from torch import nn
from transformers_helpers import NEW_TOKENS, logits_of, prompt

from expertcache.integrations.transformers import UnsupportedModelError, enable_expert_cache
from expertcache.integrations.transformers.dispatch import is_bound
from expertcache.integrations.transformers.generation import greedy_generate
from expertcache.integrations.transformers.packed_models import Mxfp4Experts, load_mxfp4_experts, quantize_experts
from expertcache.integrations.transformers.quantized import (
    DEQUANT_IMPLEMENTATION,
    QUANT_IMPLEMENTATION,
    dequant_experts_forward,
)
from expertcache.integrations.transformers.random_models import ModelSizes, random_model
from expertcache.manifest import build_manifest
from expertcache.quant_fp8 import quantize_fp8_blocks
from expertcache.quant_mxfp4 import quantize_mxfp4

finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")

# 2 MoE layers, 8 experts, top-2; H and I whole FP8 blocks of 16 and MXFP4 groups of 32
SIZES = ModelSizes(hidden=64, intermediate=32)
CACHE_SIZE = 4
BLOCK = (16, 16)
FP8_FAMILIES = ("qwen3_moe", "deepseek_v3")
TOLERANCE = 1e-5  # of the largest |logit|, fp32 on the CPU


def _experts(model) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if name.endswith("mlp.experts")}


def fp8_models(family: str, block=BLOCK, *, device: str = "cpu", dtype=torch.float32):
    """``(packed, dequantized)``: the model with transformers' ``FP8Experts`` holding
    random e4m3 weights and scales (`quantize_experts`), and the same model with
    transformers' dequantization of them as plain float experts."""
    packed = random_model(family, SIZES, dtype=dtype)
    dequantized = random_model(family, SIZES, dtype=dtype)
    assert quantize_experts(packed, "fp8", block=block) == list(_experts(dequantized))
    reference = finegrained_fp8.Fp8Dequantize(None)
    for name, module in _experts(packed).items():
        assert isinstance(module, finegrained_fp8.FP8Experts)
        for proj in ("gate_up_proj", "down_proj"):
            values, scales = module.get_parameter(proj), module.get_parameter(f"{proj}_scale_inv")
            assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
            target = dequantized.get_submodule(name).get_parameter(proj)
            target.data = reference._dequantize_one(values, scales, output_dtype=dtype)
    return packed.to(device), dequantized.to(device)


def _dequantized(weight, scale, block_size=None):
    return finegrained_fp8.Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)


def _matmul(x, weight, scale, block_size=None, output_dtype=None, activation_scale=None):
    return (x.float() @ _dequantized(weight, scale).T).to(output_dtype or x.dtype)


def _batched_matmul(x, weight, scale, block_size=None, expert_ids=None):
    w = _dequantized(weight, scale)[expert_ids]  # [S, N, K]
    return torch.bmm(w, x.float()[:, :, None])[:, :, 0].to(x.dtype)


def _grouped_matmul(x, weight, scale, offsets=None, tokens_per_expert=None, block_size=None):
    w = _dequantized(weight, scale)
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        out[start:end] = (x[start:end].float() @ w[expert].T).to(x.dtype)
        start = end
    return out


@pytest.fixture
def fp8_kernel_stand_in(monkeypatch):
    """transformers' FP8 functions with a dequantizing stand-in for the hub kernel."""
    stand_in = finegrained_fp8.FineGrainedFP8(matmul=_matmul, batched_matmul=_batched_matmul,
                                              grouped_matmul=_grouped_matmul)  # fmt: skip
    monkeypatch.setattr(finegrained_fp8, "_FINEGRAINED_FP8", stand_in)
    monkeypatch.setenv("TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR", "1")


def _with_and_without(model, implementation, **cache):
    model.set_experts_implementation(implementation)
    tokens = prompt(device=model.device.type)
    reference = greedy_generate(model, tokens, NEW_TOKENS)
    reference_logits = logits_of(model, reference.tokens.to(tokens.device))  # runs come back on the host
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE, **cache)
    cached = greedy_generate(model, tokens, NEW_TOKENS)
    cached_logits = logits_of(model, reference.tokens.to(tokens.device))
    return handle, reference, reference_logits, cached, cached_logits


def _assert_same(reference, reference_logits, cached, cached_logits, tolerance=TOLERANCE):
    assert torch.equal(cached.tokens, reference.tokens)
    scale = reference_logits.abs().max().item()
    torch.testing.assert_close(cached_logits, reference_logits, rtol=0, atol=tolerance * scale)


def _packed_bytes(model) -> int:
    return sum(p.nbytes for m in _experts(model).values() for p in m.parameters())


# transformers' functions run with the stand-in kernel; per-tensor scales on fewer of them
FP8_CASES = [
    *(pytest.param(family, BLOCK, implementation, id=f"{family}-block16-{implementation}")
      for family in FP8_FAMILIES
      for implementation in (
          DEQUANT_IMPLEMENTATION,  # ours, pure torch
          "eager",  # transformers' FP8Experts.forward (its class wrapped once per block: unwrapped)
          "batched_mm",  # transformers' fp8_batched_mm_experts_forward
          "grouped_mm",  # transformers' fp8_grouped_mm_experts_forward (histc over N slots)
      )),
    # per tensor: gate_up scales [E, 2, 1] (gate and up apart), down [E, 1, 1]
    pytest.param("qwen3_moe", None, DEQUANT_IMPLEMENTATION, id="qwen3_moe-per-tensor-dequant"),
    pytest.param("deepseek_v3", None, "grouped_mm", id="deepseek_v3-per-tensor-grouped_mm"),
]  # fmt: skip


@pytest.mark.parametrize("family, block, implementation", FP8_CASES)
def test_fp8_experts_are_served_packed(family, block, implementation, fp8_kernel_stand_in):
    model, _ = fp8_models(family, block)
    packed = {name: (p, p.detach().clone()) for name, p in model.named_parameters() if "experts" in name}
    expected_bytes = _packed_bytes(model)
    handle, reference, reference_logits, cached, cached_logits = _with_and_without(model, implementation)
    _assert_same(reference, reference_logits, cached, cached_logits)
    assert handle.stats.total.evictions > 0
    assert handle.expert_bytes == expected_bytes  # fp8 values + fp32 scales
    slots = handle.provider(handle.layers[0]).pool.tensors
    assert slots["w1"].dtype == slots["w2"].dtype == torch.float8_e4m3fn
    assert slots["gate_up_proj_scale_inv"].dtype == torch.float32
    handle.disable()
    for name, parameter in model.named_parameters():
        if name in packed:
            original, values = packed[name]
            assert parameter is original and parameter.dtype == values.dtype
            assert torch.equal(parameter.detach().view(torch.uint8), values.view(torch.uint8)), name


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block16", "per-tensor"])
@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_computation_is_transformers_dequantization(family, block):
    """Our implementation on the packed model = the float model transformers' loader makes."""
    packed, dequantized = fp8_models(family, block)
    packed.set_experts_implementation(DEQUANT_IMPLEMENTATION)
    dequantized.set_experts_implementation("eager")
    tokens = prompt()
    expected = logits_of(dequantized, tokens)
    torch.testing.assert_close(
        logits_of(packed, tokens), expected, rtol=0, atol=TOLERANCE * expected.abs().max().item()
    )
    handle = enable_expert_cache(packed, cache_size=CACHE_SIZE)
    torch.testing.assert_close(
        logits_of(packed, tokens), expected, rtol=0, atol=TOLERANCE * expected.abs().max().item()
    )
    handle.disable()


@pytest.mark.skipif(HAS_CUDA, reason="interpreted kernels on the CPU; the gpu cases cover CUDA")
@pytest.mark.parametrize("mode", ["host", "device"])
def test_fp8_triton_kernels_on_slots_match_the_reference(mode):
    """The Triton apply kernels (interpreted) on the slots give the reference's tokens."""
    model, _ = fp8_models("qwen3_moe")
    model.set_experts_implementation(DEQUANT_IMPLEMENTATION)
    tokens = prompt()
    reference = greedy_generate(model, tokens, NEW_TOKENS)
    reference_logits = logits_of(model, reference.tokens)
    model.set_experts_implementation(QUANT_IMPLEMENTATION)
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE, budget="global", mode=mode)
    cached = greedy_generate(model, tokens, NEW_TOKENS)
    _assert_same(reference, reference_logits, cached, logits_of(model, reference.tokens), tolerance=1e-4)
    assert handle.stats.total.invalid_ids == 0
    handle.disable()


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_call_in_passes_is_bit_identical_through_the_kernels(family, mode):
    """Slots for only top-k experts: a prompt needs several passes, which the kernels take
    at once (`quant_experts_passes`): the logits equal the uncached model's bit for bit
    (interpreted in fp32 on a CPU, compiled in bf16 on a GPU)."""
    device, dtype = ("cuda", torch.bfloat16) if HAS_CUDA else ("cpu", torch.float32)
    sizes = dataclasses.replace(SIZES, top_k=4)  # 4 terms a token: a split sum would round differently
    model = random_model(family, sizes, dtype=dtype).to(device)
    if family == "gpt_oss":
        quantize_experts(model, "mxfp4")
    else:
        quantize_experts(model, "fp8", block=BLOCK)
    model.set_experts_implementation(QUANT_IMPLEMENTATION)
    tokens = prompt(device=device)
    expected = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=sizes.top_k, mode=mode, budget="per-layer")
    assert torch.equal(logits_of(model, tokens), expected)
    per_layer = handle.stats.total.misses / len(handle.layers)
    assert per_layer > sizes.top_k  # more experts loaded in one call than there are slots: passes
    handle.disable()


def test_manifest_counts_packed_fp8_bytes(tmp_path):
    """What ``expertcache plan --manifest`` reads: fp8 values + fp32 scales, not bf16."""
    from expertcache.commands.plan_costs import read_manifest_sizes

    model, _ = fp8_models("qwen3_moe")
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE)
    manifest = build_manifest([handle.provider(layer) for layer in handle.layers])
    hidden, inter = SIZES.hidden, SIZES.intermediate
    scales = (2 * inter // BLOCK[0]) * (hidden // BLOCK[1]) + (hidden // BLOCK[0]) * (inter // BLOCK[1])
    packed = 3 * hidden * inter * 1 + scales * 4  # gate, up, down: one byte per weight
    assert manifest.expert_bytes == packed < 3 * hidden * inter * 2  # bf16 would be twice the weights
    dtypes = {entry.name: entry.dtype for entry in manifest.tensors}
    assert dtypes["w1"] == dtypes["w2"] == "float8_e4m3fn" and dtypes["gate_up_proj_scale_inv"] == "float32"
    manifest.write(tmp_path / "manifest.json")
    assert read_manifest_sizes(tmp_path / "manifest.json") == (packed, SIZES.num_experts)
    handle.disable()


def write_mxfp4_checkpoint(directory, *, dtype=torch.float32) -> None:
    """A tiny GPT-OSS checkpoint whose experts are MXFP4 blocks and scales, as on the hub."""
    from safetensors.torch import load_file, save_file

    random_model("gpt_oss", SIZES, dtype=dtype).save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    state = load_file(path)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = state.pop(key)  # GPT-OSS keeps x @ W: [E, H, 2I], [E, I, H]
        state[f"{key}_blocks"], state[f"{key}_scales"] = quantize_mxfp4(weight.transpose(1, 2).float())
    save_file(state, path, metadata={"format": "pt"})
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as file:
        config = json.load(file)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(config_path, "w") as file:
        json.dump(config, file)


def _load(directory, *, device="cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    config = Mxfp4Config(dequantize=True)  # what transformers does without the hub kernels
    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=config, dtype=dtype)
    # 5.17 dequantizes the experts to bf16 whatever the dtype (exactly: e2m1 times a power of two)
    return model.to(device=device, dtype=dtype).eval()


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4_checkpoint(directory)
    return directory


_INTERPRETED = pytest.mark.skipif(HAS_CUDA, reason="CPU tensors: the gpu case runs the kernels")
MXFP4_CASES = [
    pytest.param("eager", "per-layer", "host", id="eager-per-layer"),  # Mxfp4Experts.forward: torch
    pytest.param("eager", "global", "host", id="eager-global"),
    pytest.param(QUANT_IMPLEMENTATION, "per-layer", "host", id="kernels-per-layer", marks=_INTERPRETED),
    pytest.param(QUANT_IMPLEMENTATION, "global", "device", id="kernels-global-device", marks=_INTERPRETED),
]


@pytest.mark.parametrize("implementation, budget, mode", MXFP4_CASES)
def test_mxfp4_gpt_oss_is_served_packed(mxfp4_checkpoint, implementation, budget, mode):
    reference_model = _load(mxfp4_checkpoint)  # transformers' dequantization of the checkpoint
    tokens = prompt()
    reference = greedy_generate(reference_model, tokens, NEW_TOKENS)
    reference_logits = logits_of(reference_model, reference.tokens)
    model = _load(mxfp4_checkpoint)
    replaced = load_mxfp4_experts(model, mxfp4_checkpoint)
    assert replaced == list(_experts(model)) and len(replaced) == SIZES.num_moe_layers
    assert all(isinstance(m, Mxfp4Experts) and m.gate_up_proj.dtype == torch.uint8 for m in _experts(model).values())
    model.set_experts_implementation(implementation)
    uncached = logits_of(model, reference.tokens)
    scale = reference_logits.abs().max().item()
    torch.testing.assert_close(uncached, reference_logits, rtol=0, atol=TOLERANCE * scale)
    packed_bytes = _packed_bytes(model)
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE, budget=budget, mode=mode)
    _assert_same(
        reference, reference_logits, greedy_generate(model, tokens, NEW_TOKENS), logits_of(model, reference.tokens)
    )
    assert handle.expert_bytes == packed_bytes and handle.stats.total.evictions > 0
    assert handle.provider(handle.layers[0]).pool.tensors["w1"].dtype == torch.uint8
    handle.disable()


def test_generate_serves_an_mxfp4_checkpoint_packed(mxfp4_checkpoint, monkeypatch, capsys):
    """``expertcache generate`` on a GPT-OSS MXFP4 checkpoint: loaded as transformers loads it
    offline (dequantized; without this it needed accelerate and then the hub's kernels), its
    experts put back packed, the tokens those of transformers' dequantized model."""
    import expertcache.integrations.transformers as integration
    from expertcache.cli import main

    handles = []
    enable = integration.enable_expert_cache
    monkeypatch.setattr(
        integration, "enable_expert_cache", lambda *a, **kw: handles.append(enable(*a, **kw)) or handles[-1]
    )
    tokens = prompt(8)
    reference = greedy_generate(_load(mxfp4_checkpoint), tokens, 4)
    ids = " ".join(map(str, tokens[0].tolist()))
    argv = ["generate", "--model", str(mxfp4_checkpoint), "--moe-expert-cache-size", "2", "--prompt", ids,
            "--max-new-tokens", "4", "--device", "cpu", "--experts-implementation", "eager", "--compare"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"experts: MXFP4 blocks and scales of {SIZES.num_moe_layers} MoE layers, served packed" in out
    assert f"output token ids: {reference.tokens[0, tokens.shape[1] :].tolist()}" in out
    assert "without the cache: identical tokens" in out
    packed = _load(mxfp4_checkpoint)
    load_mxfp4_experts(packed, mxfp4_checkpoint)
    assert handles[0].expert_bytes == _packed_bytes(packed)  # served as the checkpoint's bytes, not dequantized


def test_generate_refuses_an_mxfp4_checkpoint_missing_a_tensor_in_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from expertcache.cli import main

    write_mxfp4_checkpoint(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state[next(key for key in state if key.endswith("experts.down_proj_blocks"))]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # what writing the checkpoint printed
    argv = ["generate", "--model", str(tmp_path), "--moe-expert-cache-size", "2", "--device", "cpu"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err and len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"expertcache generate: error: --model {tmp_path}: cannot load the weights")


def test_quantize_experts_writes_the_checkpoints_format():
    """MXFP4 in place = the blocks and scales of a checkpoint written from the same weights;
    FP8 per tensor keeps gate and up scales apart ([E, 2, 1]) as transformers does."""
    model = random_model("gpt_oss", SIZES)
    floats = {name: m.gate_up_proj.detach().clone() for name, m in _experts(model).items()}
    biases = {name: m.down_proj_bias.detach().clone() for name, m in _experts(model).items()}
    assert quantize_experts(model, "mxfp4") == list(floats)
    for name, module in _experts(model).items():
        blocks, scales = quantize_mxfp4(floats[name].transpose(1, 2))
        assert isinstance(module, Mxfp4Experts)
        assert torch.equal(module.gate_up_proj, blocks.flatten(-2)) and torch.equal(module.gate_up_proj_scales, scales)
        assert torch.equal(module.down_proj_bias, biases[name])
    per_tensor = random_model("qwen3_moe", SIZES)
    quantize_experts(per_tensor, "fp8", block=None)
    module = next(iter(_experts(per_tensor).values()))
    assert module.gate_up_proj_scale_inv.shape == (SIZES.num_experts, 2, 1)
    assert module.down_proj_scale_inv.shape == (SIZES.num_experts, 1, 1)


@pytest.mark.parametrize(
    "family, fmt, match",
    [
        ("qwen3_moe", "int4", "unknown expert format 'int4'"),
        ("gpt_oss", "fp8", "fp8 quantization needs float gated experts without biases"),
        ("qwen3_moe", "mxfp4", "mxfp4 quantization needs float GPT-OSS experts"),
        ("quantized", "fp8", "nothing was replaced"),  # already packed
        ("served", "fp8", "served by an expert cache: disable\\(\\) it before quantizing"),
        ("qwen3_moe", "fp8-block-16", "block must be None .* or two positive ints"),
        ("qwen3_moe", "fp8-block-0", "block must be None .* or two positive ints"),
        ("gpt_oss", "mxfp4-block", "block applies to fp8 only"),
    ],
)
def test_quantize_experts_refuses_what_it_cannot_write(family, fmt, match):
    if family == "quantized":
        model = fp8_models("qwen3_moe")[0]
    else:
        model = random_model("qwen3_moe" if family == "served" else family, SIZES)
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE) if family == "served" else None
    before = {name: (type(m), m.gate_up_proj.detach().clone()) for name, m in _experts(model).items()}
    fmt, _, block = fmt.partition("-")
    blocks = {"": {}, "block-16": {"block": 16}, "block-0": {"block": (0, 16)}, "block": {"block": (16, 16)}}
    with pytest.raises(ValueError, match=match):
        quantize_experts(model, fmt, **blocks[block])
    after = {name: (type(m), m.gate_up_proj.detach()) for name, m in _experts(model).items()}
    assert {n: t for n, (t, _) in after.items()} == {n: t for n, (t, _) in before.items()}
    assert all(torch.equal(after[n][1].view(torch.uint8), w.view(torch.uint8)) for n, (_, w) in before.items())
    if handle is not None:
        handle.disable()


def test_quantize_experts_failing_halfway_leaves_the_model_as_it_was(monkeypatch):
    from expertcache.integrations.transformers import packed_models

    model = random_model("qwen3_moe", SIZES)
    before = {name: (type(m), m.down_proj.detach().clone()) for name, m in _experts(model).items()}
    calls = []

    def fails_on_the_third(weight, block):
        calls.append(block)
        if len(calls) == 3:  # the second module's gate_up_proj
            raise RuntimeError("out of memory")
        return quantize_fp8_blocks(weight, block)

    monkeypatch.setattr(packed_models, "quantize_fp8_blocks", fails_on_the_third)
    with pytest.raises(RuntimeError, match="out of memory"):
        quantize_experts(model, "fp8", block=BLOCK)
    after = {name: (type(m), m.down_proj.detach()) for name, m in _experts(model).items()}
    assert [t for t, _ in after.values()] == [t for t, _ in before.values()]
    assert all(torch.equal(after[name][1], weight) for name, (_, weight) in before.items())
    monkeypatch.undo()
    assert quantize_experts(model, "fp8", block=BLOCK) == list(before)  # and it still works


def test_load_mxfp4_experts_needs_matching_modules(mxfp4_checkpoint):
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = random_model("qwen3_moe", SIZES)  # the same module names, but no GPT-OSS experts
    before = {name: type(module) for name, module in _experts(model).items()}
    with pytest.raises(ValueError, match="Qwen3MoeExperts.*not a GPT-OSS experts module.*nothing was replaced"):
        load_mxfp4_experts(model, mxfp4_checkpoint)
    assert {name: type(module) for name, module in _experts(model).items()} == before
    dense = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=24,
                                             num_hidden_layers=1, num_attention_heads=4))  # fmt: skip
    with pytest.raises(ValueError, match="no '<experts>.gate_up_proj_blocks'"):
        load_mxfp4_experts(dense, mxfp4_checkpoint)


def test_transformers_mxfp4_experts_are_refused_with_the_way_out():
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    model = random_model("gpt_oss", SIZES)
    for name in _experts(model):
        model.set_submodule(name, Mxfp4GptOssExperts(model.config))
    with pytest.raises(UnsupportedModelError, match="Mxfp4GptOssExperts.*load_mxfp4_experts"):
        enable_expert_cache(model, cache_size=CACHE_SIZE)


# On the GPU in bf16: the Triton kernels on the slots, and transformers' own FP8 grouped_mm
# where the hub kernel is installed (the GPU machine reaches no hub: usually skipped).
GPU_TOLERANCE = 2e-2
MXFP4_GPU_TOLERANCE = 5e-2  # against transformers' bf16 dequantized path (see the test)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_on_gpu_with_the_kernels(family, mode):
    model, _ = fp8_models(family, device="cuda", dtype=torch.bfloat16)
    tokens = prompt(device="cuda")
    model.set_experts_implementation(DEQUANT_IMPLEMENTATION)
    dequantized = logits_of(model, tokens)
    handle, reference, reference_logits, cached, cached_logits = _with_and_without(
        model, QUANT_IMPLEMENTATION, mode=mode
    )
    _assert_same(reference, reference_logits, cached, cached_logits, tolerance=GPU_TOLERANCE)
    scale = dequantized.abs().max().item()
    torch.testing.assert_close(logits_of(model, tokens), dequantized, rtol=0, atol=GPU_TOLERANCE * scale)
    handle.disable()


@pytest.mark.gpu
def test_fp8_on_gpu_with_transformers_hub_kernel():
    try:
        finegrained_fp8.load_finegrained_fp8_kernel()
    except ImportError as error:
        pytest.skip(f"transformers' finegrained-fp8 hub kernel is not available here: {error}")
    model, _ = fp8_models("qwen3_moe", BLOCK, device="cuda", dtype=torch.bfloat16)
    handle, reference, reference_logits, cached, cached_logits = _with_and_without(model, "grouped_mm")
    _assert_same(reference, reference_logits, cached, cached_logits, tolerance=GPU_TOLERANCE)
    handle.disable()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["host", "device"])
def test_mxfp4_on_gpu_with_the_kernels(mxfp4_checkpoint, mode):
    reference_model = _load(mxfp4_checkpoint, device="cuda", dtype=torch.bfloat16)
    reference_model.set_experts_implementation("batched_mm")
    tokens = prompt(device="cuda")
    dequantized = logits_of(reference_model, tokens)  # transformers' dequantization
    model = _load(mxfp4_checkpoint, device="cuda", dtype=torch.bfloat16)
    load_mxfp4_experts(model, mxfp4_checkpoint)
    handle, reference, reference_logits, cached, cached_logits = _with_and_without(
        model, QUANT_IMPLEMENTATION, mode=mode
    )
    _assert_same(reference, reference_logits, cached, cached_logits, tolerance=GPU_TOLERANCE)
    assert model.get_submodule(handle.layers[0]).gate_up_proj.numel() == 0  # served from the slots
    # transformers' dequantized model runs the MLP in bf16 (rounded after each matmul and
    # the activation); our kernels keep fp32 until the end: measured on the H200, 5 of
    # 1536 logits differ by up to 2.7% of the largest one
    scale = dequantized.abs().max().item()
    torch.testing.assert_close(logits_of(model, tokens), dequantized, rtol=0, atol=MXFP4_GPU_TOLERANCE * scale)
    handle.disable()


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_graphed_generator_runs_a_served_fp8_model(family):
    """The decode runner over packed FP8 experts (its eager path on the CPU): `model.generate`'s tokens."""
    from expertcache.integrations.transformers import GraphedGenerator

    model, _ = fp8_models(family)
    model.eval().set_experts_implementation(QUANT_IMPLEMENTATION)
    tokens = prompt()
    expected = greedy_generate(model, tokens, NEW_TOKENS).tokens
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE)
    runner = GraphedGenerator(model, max_length=tokens.shape[1] + NEW_TOKENS, graphs=False)
    assert torch.equal(runner.generate(tokens, max_new_tokens=NEW_TOKENS), expected)
    assert handle.stats.total.misses > 0  # the packed experts came through the slots
    del runner
    handle.disable()


@pytest.mark.gpu
@pytest.mark.parametrize("family", [*FP8_FAMILIES, "gpt_oss"])
def test_graphed_generator_over_quantized_experts_on_gpu(family):
    """bf16 on the H200: packed experts (FP8 128-blocks here 16, MXFP4 for GPT-OSS) served by a
    device-mode cache inside the runner's CUDA graphs give the uncached model's tokens."""
    from expertcache.integrations.transformers import GraphedGenerator

    model = random_model(family, SIZES, dtype=torch.bfloat16).cuda()
    if family == "gpt_oss":
        quantize_experts(model, "mxfp4")
    else:
        quantize_experts(model, "fp8", block=BLOCK)
    model.eval().set_experts_implementation(QUANT_IMPLEMENTATION)
    tokens = prompt(device="cuda")
    expected = greedy_generate(model, tokens, NEW_TOKENS).tokens
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE, mode="device")
    runner = GraphedGenerator(model, max_length=tokens.shape[1] + NEW_TOKENS, graphs=True)
    assert torch.equal(runner.generate(tokens, max_new_tokens=NEW_TOKENS).cpu(), expected)
    assert runner.replays > 0 and handle.stats.total.misses > 0  # served in the graphs
    del runner
    handle.disable()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_float_experts_through_the_kernels_are_bit_identical_in_passes(family):
    """The kernels serve float experts too (format "none"): a per-layer cache of top-k slots
    splits the prompt into passes, and the tokens and logits equal the uncached model's
    exactly; so does transformers' batched_mm on the same cache (each pair's row taken from
    its pass, the rows summed once)."""
    device, dtype = ("cuda", torch.bfloat16) if HAS_CUDA else ("cpu", torch.float32)
    sizes = dataclasses.replace(SIZES, top_k=4)
    model = random_model(family, sizes, dtype=dtype).to(device)
    model.set_experts_implementation(QUANT_IMPLEMENTATION)
    tokens = prompt(device=device)
    expected, expected_logits = greedy_generate(model, tokens, NEW_TOKENS), logits_of(model, tokens)
    handle = enable_expert_cache(
        model, cache_size=sizes.top_k, budget="per-layer", mode="device" if HAS_CUDA else "host"
    )
    assert torch.equal(greedy_generate(model, tokens, NEW_TOKENS).tokens, expected.tokens)
    assert torch.equal(logits_of(model, tokens), expected_logits)
    assert handle.stats.total.misses / len(handle.layers) > sizes.top_k  # passes
    model.set_experts_implementation("batched_mm")  # followed while served
    cached = logits_of(model, tokens)
    handle.disable()
    assert torch.equal(cached, logits_of(model, tokens))  # uncached batched_mm


def _own_gate(model):
    """Every experts module's class replaced by a subclass with its own gating (as DeepSeek-V4's clamp)."""

    def clamped(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate.clamp(max=1.0)) * up

    for module in _experts(model).values():
        module.__class__ = type("ClampedExperts", (type(module),), {"_apply_gate": clamped})


def _gelu(model):
    model.config.hidden_act = "gelu"  # the experts' config is the model's


@pytest.mark.parametrize(
    "family, change, match",
    [
        ("gpt_oss", None, r"float GptOssExperts \(has_bias, is_transposed.*GPT-OSS keeps x @ W"),
        ("qwen3_moe", _own_gate, r"float ClampedExperts \(its own _apply_gate\)"),
        ("qwen3_moe", _gelu, r"\(activation 'gelu'\): only \[E, 2I, H\] experts with transformers' default SwiGLU"),
    ],
)
@pytest.mark.parametrize("served", [False, True])
def test_float_experts_the_kernels_do_not_compute_are_refused(family, change, match, served):
    """Refused with the reason, and, served, before anything is copied (stats and slots as before)."""
    model = random_model(family, SIZES)
    if change is not None:
        change(model)
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE, budget="per-layer") if served else None
    if handle is not None:
        logits_of(model, prompt(5))  # some experts in the slots
        stats, resident = handle.stats.total, handle.provider(handle.layers[0]).resident()
    model.set_experts_implementation(QUANT_IMPLEMENTATION)
    for implementation in (QUANT_IMPLEMENTATION, DEQUANT_IMPLEMENTATION):
        model.set_experts_implementation(implementation)
        with pytest.raises(ValueError, match=match):
            logits_of(model, prompt())
    if handle is not None:
        assert handle.stats.total == stats and handle.provider(handle.layers[0]).resident() == resident
        handle.disable()


def test_an_implementation_another_registry_holds_is_refused_at_enable():
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

    FP8ExpertsInterface.register("fp8_only_test_name", dequant_experts_forward)
    model = random_model("qwen3_moe", SIZES)
    model.config._experts_implementation = "fp8_only_test_name"  # a float class's registry lacks it
    with pytest.raises(ValueError, match="'fp8_only_test_name' is not registered for Qwen3MoeExperts"):
        enable_expert_cache(model, cache_size=CACHE_SIZE)
    assert not any(is_bound(module) for module in _experts(model).values())


def test_importing_the_integration_registers_the_kernels_for_every_experts_class():
    """``set_experts_implementation("expertcache_quant")`` before any enable: float, FP8."""
    import subprocess
    import sys

    code = (
        "import expertcache.integrations.transformers as t\n"
        "from expertcache.integrations.transformers.random_models import random_model\n"
        "model = random_model('qwen3_moe')\n"
        "model.set_experts_implementation(t.QUANT_IMPLEMENTATION)\n"
        "print(model.config._experts_implementation)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-1500:]
    assert done.stdout.strip() == QUANT_IMPLEMENTATION
