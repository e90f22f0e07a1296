"""Ordinary transformers misuses of a served model, each once a silent failure or a traceback.

1. ``model.state_dict()`` (``save_pretrained``, ``torch.save(model.state_dict())``) returned
   the experts' empty placeholders: a checkpoint without experts, saved silently
   (``save_pretrained`` failed on its way with "chunk expects `chunks` to be greater than 0"
   after writing ``config.json``). It is refused, naming ``disable()``.
2. ``copy.deepcopy(model)`` and pickling (``torch.save(model)``) copied the placeholders and
   a config naming the cache that serves no copy: a model without experts that could neither
   run nor be served. Both are refused.
3. Expert parameters requiring grad while nothing before them does (fine-tuning the experts
   with the rest frozen): a backward ran and left their gradients None, silently. It now
   raises, as any backward through served experts does.
4. A model built from a served model's ``model.config`` (``from_config``, ``Model(config)``)
   holds the served model's copy of its config, which names the cache: its forward raised
   and enabling the cache on it was refused. It runs its own experts with the implementation
   the copy stands for, and can be served by a cache of its own.
5. ``expertcache generate --experts-implementation NAME`` for an implementation that cannot
   run here (transformers' ``sonicmoe`` on a CPU: ImportError) ended in a traceback.
6. ``handle.disable()`` called under ``torch.inference_mode()`` (a serving loop's teardown,
   a function decorated with it) put the experts back as inference tensors: the model could
   no longer take gradients ("Inference tensors cannot be saved for backward"), which it
   could before the cache. They come back as ordinary tensors.
7. A `GraphedGenerator` used after ``handle.disable()`` (or a new ``enable_expert_cache``)
   replayed graphs of the old cache: reads and admission writes into freed slots and tables,
   memory other tensors then hold (on the H200: "CUDA error: operation not supported on
   global/shared address space", the process's CUDA context lost). The graph is dropped and
   the step captured again.
"""

from __future__ import annotations

import copy
import io
import pickle
import re

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers_helpers import NEW_TOKENS, TINY, logits_of, prompt, tiny_model

from expertcache.cli import main
from expertcache.integrations.transformers import IMPLEMENTATION_NAME, GraphedGenerator, enable_expert_cache


def _close(cached, reference):
    scale = reference.abs().max().item()
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-5 * scale)


def _resident(handle) -> dict[str, frozenset[int]]:
    return {layer: handle.provider(layer).resident() for layer in handle.layers}


def _served(family: str = "qwen3_moe"):
    model = tiny_model(family).eval()
    tokens = prompt()
    reference = logits_of(model, tokens)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    handle = enable_expert_cache(model, cache_size=4)
    _close(logits_of(model, tokens), reference)
    return model, handle, tokens, reference, state


def _still_served(model, handle, tokens, reference, state) -> None:
    """The refused call changed nothing: the cache serves as before, disable() gives the model back."""
    stats, resident = handle.stats, _resident(handle)
    _close(logits_of(model, tokens), reference)
    assert handle.stats.total.calls == stats.total.calls + TINY.num_moe_layers
    assert _resident(handle).keys() == resident.keys()
    handle.disable()
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[name], state[name]) for name in state)


# -- 1. state_dict / save_pretrained ----------------------------------------------------------

SAVE_MESSAGE = r"served by an expert cache.*empty placeholders.*disable\(\)"


@pytest.mark.parametrize("save", ["state_dict", "save_pretrained"])
def test_saving_a_served_model_is_refused(save, tmp_path):
    model, handle, tokens, reference, state = _served()
    with pytest.raises(RuntimeError, match=SAVE_MESSAGE):  # was: the placeholders, shape (0,)
        if save == "state_dict":
            model.state_dict()
        else:
            model.save_pretrained(tmp_path)  # was: "chunk expects `chunks` to be greater than 0"
    assert not list(tmp_path.glob("*.safetensors"))
    _still_served(model, handle, tokens, reference, state)
    model.save_pretrained(tmp_path / "after")  # once disabled: the whole model
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "after").eval()
    assert torch.equal(logits_of(reloaded, tokens), logits_of(model, tokens))


# -- 2. deepcopy / pickle -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "copier",
    [
        copy.deepcopy,
        pickle.dumps,
        lambda model: torch.save(model, io.BytesIO()),
    ],
    ids=["deepcopy", "pickle", "torch.save"],
)
def test_copying_or_pickling_a_served_model_is_refused(copier):
    model, handle, tokens, reference, state = _served()
    with pytest.raises(RuntimeError, match=SAVE_MESSAGE):  # was: a copy without experts
        copier(model)
    _still_served(model, handle, tokens, reference, state)
    twin = copy.deepcopy(model)  # once disabled: an ordinary model
    assert torch.equal(logits_of(twin, tokens), logits_of(model, tokens))


# -- 3. gradients into the expert parameters ----------------------------------------------------


def test_a_backward_into_the_expert_parameters_is_refused():
    """Fine-tuning the experts (and the head) with everything before them frozen: the served
    experts' inputs do not require grad, their parameters do."""
    model = tiny_model("qwen3_moe")
    model.requires_grad_(False)
    trained = [p for name, p in model.named_parameters() if ".experts." in name or name.startswith("lm_head")]
    for parameter in trained:
        parameter.requires_grad_(True)
    tokens = prompt()
    reference = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=4)
    logits = model(tokens).logits
    _close(logits.detach(), reference)
    stats = handle.stats
    with pytest.raises(RuntimeError, match=r"backward through layer \d's Qwen3MoeExperts"):
        logits.sum().backward()  # was: ran, the experts' gradients None
    assert handle.stats == stats
    handle.disable()
    model.zero_grad()
    model(tokens).logits.sum().backward()  # uncached again: every trained parameter gets its gradient
    assert all(parameter.grad is not None for parameter in trained)


# -- 4. a model built from a served model's config ----------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_model_built_from_a_served_models_config_runs_its_own_experts(family):
    model, handle, tokens, reference, state = _served(family)
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(model.config).eval()  # holds the served model's copy
    assert other.config is model.config and other.config._experts_implementation == IMPLEMENTATION_NAME
    handle_calls = handle.stats.total.calls
    own = logits_of(other, tokens)  # was: RuntimeError, no expert cache serves this module
    assert handle.stats.total.calls == handle_calls  # its own experts, not the served model's cache
    other_handle = enable_expert_cache(other, cache_size=4)  # was: "already selects 'expertcache'"
    _close(logits_of(other, tokens), own)
    assert other_handle.stats.total.calls == TINY.num_moe_layers
    other_handle.disable()
    assert torch.equal(logits_of(other, tokens), own)
    _still_served(model, handle, tokens, reference, state)
    assert torch.equal(logits_of(other, tokens), own)


# -- 5. the command line ------------------------------------------------------------------------


def test_generate_with_an_implementation_that_cannot_run_here(checkpoint, monkeypatch, capsys):
    from transformers.integrations.moe import ExpertsInterface

    def needs_a_kernel(self, hidden_states, top_k_index, top_k_weights):
        raise ImportError("this kernel requires CUDA on an NVIDIA GPU")  # as transformers' sonicmoe on a CPU

    monkeypatch.setitem(ExpertsInterface._global_mapping, "needs_a_kernel", needs_a_kernel)
    argv = ["generate", "--model", str(checkpoint), "--moe-expert-cache-size", "4", "--device", "cpu",
            "--prompt", "1 2 3 4", "--max-new-tokens", "2", "--experts-implementation", "needs_a_kernel"]  # fmt: skip
    status = main(argv)  # was: the ImportError's traceback, exit status 1
    err = capsys.readouterr().err  # after the weights' loading bar: found at the first call
    assert status == 2 and "Traceback" not in err
    assert re.fullmatch(
        r"expertcache generate: error: the experts implementation 'needs_a_kernel' cannot run here \(.*CUDA.*\); "
        r"choose another with --experts-implementation",
        err.strip().splitlines()[-1],
    )


# -- 6. disable() under inference_mode -----------------------------------------------------------


def test_disable_under_inference_mode_gives_back_ordinary_parameters():
    model = tiny_model("qwen3_moe")
    tokens = prompt()
    handle = enable_expert_cache(model, cache_size=4)
    with torch.inference_mode():
        logits_of(model, tokens)
        handle.disable()
    experts = [p for name, p in model.named_parameters() if ".experts." in name]
    assert not any(parameter.is_inference() for parameter in experts)
    model(tokens).logits.sum().backward()  # was: "Inference tensors cannot be saved for backward"
    assert all(parameter.grad is not None for parameter in experts)


# -- 7. a graphed generator across a disable() ----------------------------------------------------


@pytest.mark.gpu
def test_a_generator_captures_again_once_the_cache_changed():
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16, device="cuda")
    model.set_experts_implementation("batched_mm")  # what generate() decodes with on a GPU
    tokens = prompt(device="cuda")
    greedy = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = model.generate(tokens, attention_mask=torch.ones_like(tokens), **greedy)
    handle = enable_expert_cache(model, cache_size=4, mode="device")
    runner = GraphedGenerator(model, max_length=tokens.shape[1] + NEW_TOKENS, graphs=True)
    assert torch.equal(runner.generate(tokens, max_new_tokens=NEW_TOKENS), expected)
    assert runner.captured_buckets == (1,)
    replays = runner.replays
    handle.disable()
    # the freed slots and tables taken by other tensors, as they would be in a running program
    taken = [torch.full((1 << 14,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(512)]
    assert torch.equal(runner.generate(tokens, max_new_tokens=NEW_TOKENS), expected)  # was: the old graph
    assert all(bool(tensor.isnan().all()) for tensor in taken)  # nothing wrote into them
    handle = enable_expert_cache(model, cache_size=6, mode="device")
    assert torch.equal(runner.generate(tokens, max_new_tokens=NEW_TOKENS), expected)
    assert runner.captured_buckets == (1,) and runner.replays > replays  # captured again, replayed
    assert handle.stats.total.calls > 0
    del runner
    handle.disable()
