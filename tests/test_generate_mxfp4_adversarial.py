"""``expertcache generate`` on GPT-OSS MXFP4 checkpoints, attacked; and served parameters
changed behind the cache.

1. What the cache would refuse about an MXFP4 checkpoint's experts is refused before any
   weight is read, in one line, nothing on stdout: an experts implementation `Mxfp4Experts`
   has no function for (``sonicmoe``), a pin budget or a compression the packed bytes do not
   fit, blocks or scales of the wrong dtype, a module missing one of its six tensors, a
   checkpoint holding dense experts beside their MXFP4 blocks (it was served the blocks while
   transformers computed with the dense ones: other tokens), biases whose dtypes differ between
   layers under the global budget, a ``pytorch_model.bin``, a non-GPT-OSS model claiming
   mxfp4. These used to be found after transformers had loaded (dequantized) the whole
   checkpoint, with ``experts: ... served packed`` already on stdout.
2. A refusal after the load prints its one line only: transformers' held load report and the
   ``experts:`` line come once the cache is enabled (they came before, then the error).
3. ``--experts-implementation deepgemm_megamoe`` (transformers: a load-time choice) is one line,
   exit status 2 (it was a RuntimeError traceback).
4. Accepted runs generate transformers' own dequantized model's tokens: each experts
   implementation, host and device mode, both budgets, ``--save-trace``, ``--compare``, a
   sharded checkpoint with an index and an unexpected key, a bf16 checkpoint.
5. Served parameters: one deleted (``delattr``) is refused with the cache's error (it was a
   bare AttributeError from the pre-hook); weights put in by ``resize_``/``set_``/
   ``register_parameter``/a parametrization are refused; legitimate operations on a served
   model (``to``, a cast and back, ``requires_grad_``, ``train``/``eval``, ``tie_weights``,
   ``torch.compile``, ``GraphedGenerator(graphs=False)``, disable and enable again, two models)
   are not, for every family and the FP8 / MXFP4 packed modules.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import HAS_CUDA
from test_transformers_quantized import SIZES, fp8_models, write_mxfp4_checkpoint
from torch import nn
from transformers_helpers import logits_of, prompt, tiny_model

from expertcache.cli import main
from expertcache.integrations.transformers import GraphedGenerator, enable_expert_cache
from expertcache.integrations.transformers.generation import greedy_generate
from expertcache.integrations.transformers.packed_models import quantize_experts
from expertcache.integrations.transformers.quantized import DEQUANT_IMPLEMENTATION
from expertcache.integrations.transformers.random_models import random_model

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
NEW = 4
PREFIX = "expertcache generate: error: "
LAYER0 = "model.layers.0.mlp.experts."


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mxfp4_base")
    write_mxfp4_checkpoint(directory)
    return directory


def _checkpoint(base, directory, *, state=None, config=None):
    """A copy of ``base`` with ``state(tensors)`` / ``config(dict)`` applied in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, directory, dirs_exist_ok=True)
    if state is not None:
        tensors = load_file(directory / "model.safetensors")
        state(tensors)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        values = json.loads((directory / "config.json").read_text())
        config(values)
        (directory / "config.json").write_text(json.dumps(values))
    return directory


def _generate(directory, capfd, *extra, device="cpu"):
    import sys

    from transformers.utils import logging as transformers_logging

    capfd.readouterr()  # what writing the checkpoint printed
    argv = ["generate", "--model", str(directory), "--moe-expert-cache-size", "2", "--prompt",
            " ".join(map(str, PROMPT)), "--max-new-tokens", str(NEW), "--device", device, *extra]  # fmt: skip
    # transformers' log handler (its load report) keeps the sys.stderr of the process's first log,
    # in pytest an earlier test's capture: write to this one's while generate runs
    transformers_logging.get_verbosity()  # sets the handler up
    handler = transformers_logging._default_handler
    kept = handler.stream, handler.flush
    handler.stream, handler.flush = sys.stderr, sys.stderr.flush
    try:
        status = main(argv)
    except SystemExit as end:  # parser.error: its line is on stderr
        status = end.code
    finally:
        handler.stream, handler.flush = kept
    captured = capfd.readouterr()
    return status, captured.out, captured.err


def _assert_refused(status, out, err, match):
    import re

    assert status == 2, (out, err)
    assert out == "" and "Traceback" not in err, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    assert re.search(match, lines[0]), lines[0]


@pytest.fixture
def weights_never_read(monkeypatch):
    """Fail the test if ``generate`` starts loading the checkpoint's weights."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were read before the request was refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def _reference(directory) -> list[int]:
    """The new tokens of transformers' own dequantized model (``dtype="auto"``, as generate)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=Mxfp4Config(dequantize=True), dtype="auto"
    ).eval()
    run = greedy_generate(model, torch.tensor([PROMPT]), NEW)
    return run.tokens[0, len(PROMPT) :].tolist()


# -- 1. refused before any weight is read -------------------------------------------------------


def _pop(key):
    return lambda tensors: tensors.pop(LAYER0 + key)


def _retype(key, dtype):
    return lambda tensors: tensors.__setitem__(LAYER0 + key, tensors[LAYER0 + key].to(dtype))


def _cut(key):
    return lambda tensors: tensors.__setitem__(LAYER0 + key, tensors[LAYER0 + key][:, :-2].contiguous())


def _dense_beside_blocks(tensors):
    tensors[LAYER0 + "gate_up_proj"] = torch.zeros(SIZES.num_experts, SIZES.hidden, 2 * SIZES.intermediate)


def _as_pytorch_bin(directory):
    from safetensors.torch import load_file

    torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()


def _qwen3_claiming_mxfp4(directory):
    for path in directory.iterdir():
        path.unlink()
    random_model("qwen3_moe", SIZES).save_pretrained(directory)
    values = json.loads((directory / "config.json").read_text())
    values["quantization_config"] = {"quant_method": "mxfp4"}
    (directory / "config.json").write_text(json.dumps(values))


def _index_not_json(directory):
    _sharded(directory)  # the shards, then an index that is not JSON in place of theirs
    (directory / "model.safetensors.index.json").write_text("{not json")


def _zero_dim_blocks(tensors):
    tensors[LAYER0 + "gate_up_proj_blocks"] = torch.tensor(7, dtype=torch.uint8)


REFUSED_BEFORE_LOADING = [
    pytest.param({}, ["--experts-implementation", "sonicmoe"], None,
                 r"--experts-implementation sonicmoe: .*'sonicmoe' is not registered for Mxfp4Experts "
                 r"\(its registry holds batched_mm, eager, ", id="sonicmoe"),
    pytest.param({}, ["--moe-pin-budget", "1000"], None, r"pinned backing store needs \d+ bytes", id="pin-budget"),
    pytest.param({}, ["--moe-expert-cache-compression", "exponent"], None,
                 r"compression='exponent' codes bfloat16 or float16 experts.*uint8", id="exponent-on-uint8"),
    pytest.param({"state": _retype("gate_up_proj_scales", torch.float32)}, [], None,
                 r"--model .*: cannot load the weights \(MXFP4 gate_up_proj_scales must be uint8", id="scales-float32"),
    pytest.param({"state": _cut("gate_up_proj_scales")}, [], None,
                 r"cannot load the weights \(MXFP4 gate_up_proj_scales must be uint8 \[8, 64, 2\], got torch.uint8 "
                 r"\[8, 62, 2\]", id="scales-short"),  # was: named gate_up_proj, whose shape is right
    pytest.param({"state": _zero_dim_blocks}, [], None,
                 r"gate_up_proj_blocks has shape \[\]: not an MXFP4 checkpoint tensor", id="blocks-0-dim"),
    pytest.param({"state": _retype("down_proj_blocks", torch.int8)}, [], None,
                 r"--model .*: cannot load the weights \(MXFP4 down_proj must be uint8", id="blocks-int8"),
    pytest.param({"state": _pop("down_proj_scales")}, [], None,
                 r"holds model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks but not .*down_proj_scales",
                 id="no-scales"),
    pytest.param({"state": _pop("gate_up_proj_bias")}, [], None, r"but not .*gate_up_proj_bias", id="no-bias"),
    pytest.param({"state": _dense_beside_blocks}, [], None,
                 r"holds model\.layers\.0\.mlp\.experts\.gate_up_proj beside the MXFP4 blocks",
                 id="dense-beside-blocks"),
    pytest.param({"state": _retype("gate_up_proj_bias", torch.bfloat16)}, [], None,
                 r"--moe-expert-cache-budget global: budget 'global' needs every MoE layer's experts .*"
                 r"model\.layers\.1\.mlp\.experts.*per-layer",
                 id="bias-dtypes-differ-global"),
    pytest.param({}, [], _as_pytorch_bin, r"has neither model\.safetensors nor model\.safetensors\.index",
                 id="pytorch-bin"),
    pytest.param({}, [], _qwen3_claiming_mxfp4, r"no '<experts>\.gate_up_proj_blocks'", id="qwen3-claims-mxfp4"),
    pytest.param({}, [], _index_not_json, r"model\.safetensors\.index\.json", id="index-not-json"),
]  # fmt: skip


@pytest.mark.parametrize("edit, flags, rewrite, match", REFUSED_BEFORE_LOADING)
def test_what_the_packed_experts_cannot_do_is_refused_before_loading(
    base_checkpoint, tmp_path, capfd, weights_never_read, edit, flags, rewrite, match
):
    directory = _checkpoint(base_checkpoint, tmp_path / "ckpt", **edit)
    if rewrite is not None:
        rewrite(directory)
    before = sorted(path.name for path in directory.iterdir())
    _assert_refused(*_generate(directory, capfd, *flags), match)
    assert sorted(path.name for path in directory.iterdir()) == before  # nothing written


def test_dense_experts_beside_their_blocks_were_served_other_tokens_than_transformers(base_checkpoint, tmp_path, capfd):
    """The defect the refusal above replaces: transformers computes with the dense tensor, the
    cache served the blocks, so the tokens differed from transformers' and nothing was said."""
    directory = _checkpoint(base_checkpoint, tmp_path / "ckpt", state=_dense_beside_blocks)
    status, out, err = _generate(directory, capfd)
    assert status == 2 and out == "" and len(err.splitlines()) == 1
    assert _reference(directory) != _reference(base_checkpoint)  # transformers did not use the blocks


# -- 2. a refusal after the load is one line ----------------------------------------------------


def test_a_refusal_after_the_load_holds_back_the_load_report_and_stdout(base_checkpoint, tmp_path, capfd, monkeypatch):
    import expertcache.integrations.transformers as integration

    def refuse(*args, **kwargs):
        raise ValueError("stand-in: the cache refused this model")

    monkeypatch.setattr(integration, "enable_expert_cache", refuse)
    unexpected = _checkpoint(base_checkpoint, tmp_path / "ckpt",
                             state=lambda tensors: tensors.__setitem__("extra.unused", torch.zeros(3)))  # fmt: skip
    _assert_refused(*_generate(unexpected, capfd), r"stand-in: the cache refused this model")


# -- 3. a load-time experts implementation ------------------------------------------------------


def test_a_load_time_experts_implementation_is_one_line(base_checkpoint, capfd, weights_never_read):
    status, out, err = _generate(base_checkpoint, capfd, "--experts-implementation", "deepgemm_megamoe")
    _assert_refused(status, out, err, r"--experts-implementation deepgemm_megamoe: .*load-time")


# -- 4. accepted runs: transformers' tokens ----------------------------------------------------


@pytest.fixture(scope="module")
def reference_tokens(base_checkpoint):
    return _reference(base_checkpoint)


ACCEPTED = [
    pytest.param("batched_mm", "host", "per-layer", ["--compare"], id="batched_mm-host-per-layer"),
    pytest.param("grouped_mm", "device", "global", ["--compare"], id="grouped_mm-device-global"),
    pytest.param("expertcache_quant", "device", "per-layer", [], id="kernels-device-per-layer"),
    pytest.param(DEQUANT_IMPLEMENTATION, "host", "global", ["--compare"], id="dequant-host-global"),
    pytest.param(None, "host", "global", ["--save-trace"], id="default-save-trace"),
]


@pytest.mark.parametrize("implementation, mode, budget, flags", ACCEPTED)
def test_accepted_runs_generate_transformers_tokens(
    base_checkpoint, reference_tokens, tmp_path, capfd, implementation, mode, budget, flags
):
    if flags == ["--save-trace"]:
        flags = ["--save-trace", str(tmp_path / "trace.npz")]
    chosen = [] if implementation is None else ["--experts-implementation", implementation]
    # device mode on the CPU runs Triton's interpreter, which a machine with a GPU does not set up
    device = "cuda" if mode == "device" and HAS_CUDA else "cpu"
    status, out, err = _generate(base_checkpoint, capfd, *chosen, "--moe-expert-cache-mode", mode,
                                 "--moe-expert-cache-budget", budget, *flags, device=device)  # fmt: skip
    assert status == 0, err
    packed = f"experts: MXFP4 blocks and scales of {SIZES.num_moe_layers} MoE layers, served packed"
    assert out.splitlines()[0] == packed
    assert f"output token ids: {reference_tokens}" in out
    assert f"budget {budget}" in out
    if "--compare" in flags:
        assert "without the cache: identical tokens" in out
    if "--save-trace" in flags:
        assert (tmp_path / "trace.npz").is_file() and "routing trace:" in out


def _sharded(directory):
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in halves.items():
        save_file({key: tensors[key] for key in part}, directory / name, metadata={"format": "pt"})
    weight_map = {key: name for name, part in halves.items() for key in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_sharded_checkpoint_with_an_unexpected_key_generates_transformers_tokens(base_checkpoint, tmp_path, capfd):
    directory = _checkpoint(base_checkpoint, tmp_path / "ckpt",
                            state=lambda tensors: tensors.__setitem__("extra.unused", torch.zeros(3)))  # fmt: skip
    _sharded(directory)
    status, out, err = _generate(directory, capfd, "--compare")
    assert status == 0, err
    assert f"output token ids: {_reference(directory)}" in out and "identical tokens" in out
    assert "extra.unused" in err and "UNEXPECTED" in err  # transformers' report, shown for an accepted load


def test_beside_model_safetensors_an_index_is_not_read(base_checkpoint, tmp_path, capfd):
    """transformers loads ``model.safetensors`` when both are there: the packed experts come
    from it too (they came from the index's shards, whose scales differ here: other tokens)."""
    from safetensors.torch import load_file, save_file

    directory = _checkpoint(base_checkpoint, tmp_path / "ckpt")
    tensors = load_file(directory / "model.safetensors")
    other = {key: value + 1 if key.endswith("_scales") else value for key, value in tensors.items()}
    save_file(other, directory / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    weight_map = dict.fromkeys(other, "model-00001-of-00001.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    status, out, err = _generate(directory, capfd)
    assert status == 0, err
    assert f"output token ids: {_reference(directory)}" in out


def test_a_bf16_checkpoint_generates_transformers_tokens(tmp_path, capfd):
    write_mxfp4_checkpoint(tmp_path, dtype=torch.bfloat16)
    values = json.loads((tmp_path / "config.json").read_text())
    assert values["dtype"] == "bfloat16"
    status, out, err = _generate(tmp_path, capfd, "--compare")
    assert status == 0, err
    assert "bfloat16 on cpu" in out and f"output token ids: {_reference(tmp_path)}" in out


# -- 5. served parameters changed behind the cache ----------------------------------------------


def _served_qwen3():
    model = tiny_model("qwen3_moe").eval()
    experts = next(module for name, module in model.named_modules() if name.endswith("mlp.experts"))
    full = experts.gate_up_proj.detach().clone()
    return model, experts, full


def test_a_deleted_served_parameter_is_refused_with_the_caches_error():
    model, experts, full = _served_qwen3()
    handle = enable_expert_cache(model, cache_size=4)
    delattr(experts, "gate_up_proj")
    with pytest.raises(RuntimeError, match=r"Qwen3MoeExperts\.gate_up_proj was deleted .*nothing was computed"):
        logits_of(model, prompt(6))
    assert handle.stats.total.calls == 0


def _resized(experts, full):
    experts.gate_up_proj.requires_grad_(False)  # resize_ refuses a parameter that requires grad
    with torch.no_grad():
        experts.gate_up_proj.resize_(full.shape).copy_(full)


def _set(experts, full):
    with torch.no_grad():
        experts.gate_up_proj.set_(full)


def _registered(experts, full):
    experts.register_parameter("gate_up_proj", nn.Parameter(full, requires_grad=False))


def _parametrized(experts, full):
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, weight):
            return 2 * weight

    parametrize.register_parametrization(experts, "gate_up_proj", Doubled())


@pytest.mark.parametrize("change", [_resized, _set, _registered, _parametrized])
def test_weights_put_in_behind_the_cache_are_refused(change):
    model, experts, full = _served_qwen3()
    handle = enable_expert_cache(model, cache_size=4)
    change(experts, full)
    with pytest.raises(RuntimeError, match=r"gate_up_proj was replaced, refilled or tied"):
        logits_of(model, prompt(6))
    assert handle.stats.total.calls == 0


def _legitimate_operations(model, handle, tokens):
    """Everything here leaves the served model computing what it computed: no refusal."""
    model.to("cpu")
    model.to(torch.device("cpu"), non_blocking=True)
    if not any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):  # .double() casts FP8 too
        model.double()
        model.float()  # back: the placeholders' dtype is the cached one again
    if all(p.is_floating_point() for p in model.parameters()):  # uint8 blocks cannot require grad
        model.requires_grad_(True)
    model.requires_grad_(False)
    model.train()
    model.eval()
    model.tie_weights()
    runner = GraphedGenerator(model, max_length=tokens.shape[1] + 3, graphs=False)
    runner.generate(tokens, max_new_tokens=3)
    handle.disable()
    return enable_expert_cache(model, cache_size=3)


def _fp8(family):
    def build():
        model = fp8_models(family)[0]
        model.set_experts_implementation(DEQUANT_IMPLEMENTATION)
        return model

    return build


def _mxfp4():
    model = random_model("gpt_oss", SIZES)
    quantize_experts(model, "mxfp4")
    return model


def _family(family):
    return lambda: tiny_model(family)


BUILDERS = [
    *(pytest.param(_family(family), id=family)
      for family in ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss")),
    pytest.param(_fp8("qwen3_moe"), id="fp8-qwen3_moe"),
    pytest.param(_fp8("deepseek_v3"), id="fp8-deepseek_v3"),
    pytest.param(_mxfp4, id="mxfp4-gpt_oss"),
]  # fmt: skip


@pytest.mark.parametrize("build", BUILDERS)
def test_legitimate_operations_on_a_served_model_are_not_refused(build):
    model = build().eval()
    tokens = prompt(8)
    reference = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=4)
    handle = _legitimate_operations(model, handle, tokens)
    torch.testing.assert_close(logits_of(model, tokens), reference, rtol=1e-5, atol=1e-5)
    other = build().eval()  # a second served model beside it
    other_handle = enable_expert_cache(other, cache_size=4)
    torch.testing.assert_close(logits_of(other, tokens), logits_of(model, tokens), rtol=1e-5, atol=1e-5)
    other_handle.disable()
    handle.disable()
    torch.testing.assert_close(logits_of(model, tokens), reference, rtol=1e-5, atol=1e-5)


def test_a_compiled_served_model_runs_and_still_refuses_new_weights():
    model, experts, full = _served_qwen3()
    tokens = prompt(6)
    reference = logits_of(model, tokens)
    enable_expert_cache(model, cache_size=4)
    compiled = torch.compile(model, backend="eager")
    torch.testing.assert_close(logits_of(compiled, tokens), reference, rtol=1e-5, atol=1e-5)
    experts.gate_up_proj.data = full
    with pytest.raises(RuntimeError, match=r"gate_up_proj was replaced, refilled or tied"):
        logits_of(compiled, tokens)


def test_disable_after_the_placeholders_were_replaced_by_a_conversion_restores_the_experts():
    model, experts, full = _served_qwen3()
    handle = enable_expert_cache(model, cache_size=4)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to(torch.float32)  # new Parameter objects, each an empty placeholder
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert experts.gate_up_proj.numel() == 0  # a new empty Parameter: still a placeholder, served
    tokens = prompt(12)
    served = logits_of(model, tokens)
    handle.disable()
    assert torch.equal(experts.gate_up_proj, full)
    assert torch.allclose(served, logits_of(model, tokens), rtol=1e-5, atol=1e-5)
