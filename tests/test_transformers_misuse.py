"""Misuse of the transformers integration: each case gets a clear error and changes nothing.

1. `load_mxfp4_experts` on a model an expert cache serves is refused (it used to swap the
   served modules out, so the next forward failed and ``disable()`` restored orphans).
2. `load_mxfp4_experts` with a checkpoint missing a module's tensor, or holding something
   that is not a tensor, names the tensor (it was a bare KeyError / AttributeError).
3. `load_mxfp4_experts` and `quantize_experts` refuse a model that is not a module.
4. `GraphedGenerator.generate` refuses ``pad_token_id`` without ``eos_token_id`` (ignored).
5. `GraphedGenerator(graphs=False, warmup_steps=N)` refuses a warm-up it would ignore.
6. ``expertcache generate --experts-implementation expertcache`` (the cache itself) is one
   line and exit status 2 (it was a RuntimeError traceback after the weights loaded).
7. CUDA graphs over transformers' ``eager`` experts loop (a ``nonzero`` every layer, served
   or not) are refused by ``graphs=True`` and ``--graphs``, and ``"auto"`` runs eagerly (it
   used to pick graphs and fail at capture).
8. A served expert parameter changed without ``load_state_dict`` (``param.data = w``, a new
   Parameter) is refused at the next forward before the cache runs (the new weights were
   ignored without a word); put back, the model computes as before. A new *empty* Parameter
   (accelerate's ``set_module_tensor_to_device`` moving a placeholder) is a placeholder too:
   served as before, and ``disable()`` puts the experts back into it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers_helpers import TINY, logits_of, prompt, tiny_model

from expertcache.cli import main
from expertcache.integrations.transformers import GraphedGenerator, enable_expert_cache
from expertcache.integrations.transformers.decode_setup import resolve_graphs
from expertcache.integrations.transformers.dispatch import register
from expertcache.integrations.transformers.packed_models import load_mxfp4_experts, quantize_experts

PARTS = ("gate_up_proj", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj", "down_proj_scales", "down_proj_bias")


@pytest.fixture(scope="module")
def mxfp4_checkpoint() -> dict[str, torch.Tensor]:
    """The tiny GPT-OSS model's experts as an MXFP4 checkpoint (name -> tensor)."""
    packed = tiny_model("gpt_oss")
    names = quantize_experts(packed, "mxfp4")
    checkpoint = {}
    for name in names:
        module = packed.get_submodule(name)
        for part in PARTS:
            key = part + "_blocks" if part in ("gate_up_proj", "down_proj") else part
            checkpoint[f"{name}.{key}"] = getattr(module, part).detach()
    return checkpoint


def _modules(model) -> dict:
    return dict(model.named_modules())


# -- 1-3. load_mxfp4_experts / quantize_experts ----------------------------------------------


def test_load_mxfp4_into_a_served_model_is_refused(mxfp4_checkpoint):
    model = tiny_model("gpt_oss")
    tokens = prompt(6)
    handle = enable_expert_cache(model, cache_size=4)
    served, modules = logits_of(model, tokens), _modules(model)
    with pytest.raises(ValueError, match="served by an expert cache: disable"):
        load_mxfp4_experts(model, mxfp4_checkpoint)
    assert _modules(model) == modules  # nothing replaced
    assert torch.equal(logits_of(model, tokens), served)  # still served
    handle.disable()
    assert load_mxfp4_experts(model, mxfp4_checkpoint)  # once disabled, it loads


@pytest.mark.parametrize(
    "change, error, match",
    [
        ("drop", ValueError, "holds model.layers.1.mlp.experts.gate_up_proj_blocks but not .*down_proj_scales"),
        ("list", TypeError, r"checkpoint\['model.layers.1.mlp.experts.down_proj_scales'\] must be a torch.Tensor"),
        # transformers computes with the dense weight: the blocks beside it would be other experts
        ("dense", ValueError, r"holds model.layers.1.mlp.experts.down_proj beside the MXFP4 blocks"),
    ],
)
def test_load_mxfp4_names_a_missing_or_bad_tensor(mxfp4_checkpoint, change, error, match):
    model = tiny_model("gpt_oss")
    modules = _modules(model)
    checkpoint = dict(mxfp4_checkpoint)
    key = "model.layers.1.mlp.experts.down_proj_scales"
    if change == "drop":
        del checkpoint[key]
    elif change == "dense":
        checkpoint["model.layers.1.mlp.experts.down_proj"] = torch.zeros(2)
    else:
        checkpoint[key] = checkpoint[key].tolist()
    with pytest.raises(error, match=match):
        load_mxfp4_experts(model, checkpoint)
    assert _modules(model) == modules


@pytest.mark.parametrize("model", [None, "gpt_oss"])
def test_packing_functions_refuse_a_model_that_is_not_a_module(mxfp4_checkpoint, model):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        load_mxfp4_experts(model, mxfp4_checkpoint)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        quantize_experts(model, "fp8")


# -- 4-5. GraphedGenerator settings it would ignore ------------------------------------------


@pytest.fixture(scope="module")
def runner():
    return GraphedGenerator(tiny_model("qwen3_moe"), max_length=16, graphs=False)


def test_pad_token_without_eos_is_refused(runner):
    prompts = prompt(4)
    before = runner.generate(prompts, max_new_tokens=3)
    with pytest.raises(ValueError, match="pad_token_id=0 given without eos_token_id"):
        runner.generate(prompts, max_new_tokens=3, pad_token_id=0)
    assert torch.equal(runner.generate(prompts, max_new_tokens=3), before)


def test_a_warmup_without_graphs_is_refused(runner):
    with pytest.raises(ValueError, match="warmup_steps=5 given with graphs=False"):
        GraphedGenerator(runner.model, max_length=16, graphs=False, warmup_steps=5)
    assert GraphedGenerator(runner.model, max_length=16, graphs=False, warmup_steps=2).warmup_steps == 2


# -- 6. the command line ---------------------------------------------------------------------


def test_generate_refuses_the_cache_as_its_own_experts_implementation(tmp_path, capsys):
    tiny_model("qwen2_moe").save_pretrained(tmp_path)
    register()  # as after any enable in this process: transformers' setter then accepts the name
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tmp_path), "--moe-expert-cache-size", str(TINY.top_k + 2),
              "--device", "cpu", "--max-new-tokens", "2", "--experts-implementation", "expertcache"])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--experts-implementation expertcache" in err and "Traceback" not in err


# -- 7. graphs over the eager experts loop ---------------------------------------------------


@pytest.mark.parametrize("served", [False, True], ids=["plain", "served"])
def test_graphs_over_the_eager_experts_loop_are_refused(served):
    import os

    if served and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a device-mode cache on the CPU needs TRITON_INTERPRET=1")
    model, cuda = tiny_model("qwen3_moe"), torch.device("cuda")  # the decision only, no CUDA needed
    model.set_experts_implementation("eager")
    handle = enable_expert_cache(model, cache_size=4, mode="device") if served else None
    with pytest.raises(ValueError, match="'eager' experts implementation finds the experts a layer hit"):
        resolve_graphs(model, True, cuda)
    assert resolve_graphs(model, "auto", cuda) is False  # auto: the eager path
    model.set_experts_implementation("batched_mm")  # served: the cache now calls batched_mm on its slots
    assert resolve_graphs(model, True, cuda) and resolve_graphs(model, "auto", cuda)
    if handle is not None:
        handle.disable()


def test_generate_graphs_refuse_the_eager_experts_loop(tmp_path, capsys):
    tiny_model("qwen2_moe").save_pretrained(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tmp_path), "--moe-expert-cache-size", str(TINY.top_k + 2), "--graphs",
              "--moe-expert-cache-mode", "device", "--max-new-tokens", "2",
              "--experts-implementation", "eager"])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--experts-implementation eager" in err and "Traceback" not in err


def test_generate_help_says_the_cache_size_is_required(capsys):
    """It said "omit to keep every expert on the GPU", which generate refuses; an engine's
    parser (no cache without the flag) still says so."""
    import argparse

    from expertcache.cli import add_cache_arguments

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "experts per layer); required" in text and "omit to keep every expert" not in text
    engine = argparse.ArgumentParser()
    add_cache_arguments(engine)
    assert "omit to keep every expert on the GPU" in " ".join(engine.format_help().split())


# -- 8. served parameters changed behind the cache's back --------------------------------------


def _refill(module, name, full):
    getattr(module, name).data = full  # the Parameter object stays, its data is the weights


def _new_parameter(module, name, full):
    setattr(module, name, nn.Parameter(full, requires_grad=False))


def _served():
    """A served tiny model, its uncached logits, its first experts module and that module's
    ``gate_up_proj`` weights (taken before serving)."""
    model = tiny_model("qwen3_moe")
    tokens = prompt(12)
    reference = logits_of(model, tokens)
    experts = next(module for name, module in model.named_modules() if name.endswith("mlp.experts"))
    full = experts.gate_up_proj.detach().clone()
    return model, tokens, reference, experts, full, enable_expert_cache(model, cache_size=4)


@pytest.mark.parametrize("change", [_refill, _new_parameter])
def test_a_served_parameter_changed_without_load_state_dict_is_refused(change):
    model, tokens, reference, experts, full, handle = _served()
    placeholder = experts.gate_up_proj
    change(experts, "gate_up_proj", full)
    with pytest.raises(RuntimeError, match=r"gate_up_proj was replaced, refilled or tied.*disable\(\)"):
        logits_of(model, tokens)
    assert handle.stats.total.calls == 0  # refused before the cache ran
    experts._parameters["gate_up_proj"] = placeholder  # the change undone: served again
    placeholder.data = torch.empty(0, dtype=full.dtype)
    assert torch.allclose(logits_of(model, tokens), reference, rtol=1e-5, atol=1e-5)
    assert handle.stats.total.calls == TINY.num_moe_layers
    handle.disable()
    assert torch.equal(experts.gate_up_proj, full)


def test_a_new_empty_placeholder_is_served_and_disable_fills_it():
    model, tokens, reference, experts, full, handle = _served()
    new = nn.Parameter(torch.empty(0, dtype=full.dtype), requires_grad=False)
    experts._parameters["gate_up_proj"] = new  # as set_module_tensor_to_device(experts, "gate_up_proj", device)
    assert torch.allclose(logits_of(model, tokens), reference, rtol=1e-5, atol=1e-5)
    handle.disable()
    assert experts.gate_up_proj is new and torch.equal(new, full)


def test_a_tie_to_another_served_parameter_is_refused():
    """Another layer's placeholder (or the module's other one) in a served parameter's place
    is no placeholder of this one: served, it would compute with the other's experts."""
    model, tokens, reference, experts, full, handle = _served()
    layers = [module for name, module in model.named_modules() if name.endswith("mlp.experts")]
    layers[1].gate_up_proj = layers[0].gate_up_proj
    with pytest.raises(RuntimeError, match=r"gate_up_proj was replaced, refilled or tied"):
        logits_of(model, tokens)
    layers[1].gate_up_proj = layers[1].down_proj  # within one module
    with pytest.raises(RuntimeError, match=r"gate_up_proj was replaced, refilled or tied"):
        logits_of(model, tokens)
    assert handle.stats.per_layer["model.layers.1.mlp.experts"].calls == 0  # refused before it ran
    handle.disable()
    assert torch.equal(layers[0].gate_up_proj, full)  # the first layer's own experts, where they were


def test_disable_refuses_to_put_experts_on_the_meta_device():
    model, tokens, reference, experts, full, handle = _served()
    experts.to("meta")  # new empty Parameters on the meta device
    for to in ("original", "cpu"):
        with pytest.raises(ValueError, match=r"gate_up_proj is on the meta device.*to_empty.*nothing changed"):
            handle.disable(to=to)
    assert handle.enabled
    experts.to_empty(device="cpu")  # empty placeholders on a real device again
    handle.disable()
    assert torch.equal(experts.gate_up_proj, full)
