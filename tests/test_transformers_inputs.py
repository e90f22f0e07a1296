"""Bad input to the transformers integration: a clear error naming the argument, before any work.

Every refused `GraphedGenerator.generate` request, construction, `bucket_for` and
`enable_expert_cache` call below raises a TypeError or ValueError that names what was wrong;
the cache's counters are as before the call (nothing was prefilled or decoded), and the
runner and the model then generate exactly the tokens they generated before. A setting the
call would not use (sampling settings without ``do_sample``) is refused, never ignored.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from transformers_helpers import TINY, prompt, tiny_model

from expertcache.integrations.transformers import GraphedGenerator, enable_expert_cache
from expertcache.integrations.transformers.generation import greedy_generate
from expertcache.trace import RoutingRecorder

NEW = 5
PROMPT = 6
VOCAB = TINY.vocab  # 128
EOS = object()  # stands for an EOS id that ends row 0 at once while row 1 goes on


def _stats(handle):
    stats = handle.stats
    return stats.total, dict(stats.per_layer)


@pytest.fixture(scope="module")
def served():
    """A served model, its eager runner (bucket 2), two prompts and their greedy tokens."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe")
    handle = enable_expert_cache(model, cache_size=4)
    runner = GraphedGenerator(model, max_length=32, max_batch_size=2, graphs=False)
    prompts = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    baseline = runner.generate(prompts, max_new_tokens=NEW)
    eos = int(baseline[0, PROMPT])
    assert eos not in baseline[1, PROMPT:].tolist()  # row 1 goes on, so a finished row 0 emits the pad
    yield types.SimpleNamespace(model=model, handle=handle, runner=runner, prompts=prompts, baseline=baseline, eos=eos)
    handle.disable()


def _refused(served, error, match, **request):
    """``generate(**request)`` raises ``error`` matching ``match``, and changes nothing."""
    request = {"max_new_tokens": NEW, **request}
    if request.get("eos_token_id") is EOS:
        request["eos_token_id"] = served.eos
    before = _stats(served.handle)
    with pytest.raises(error, match=match):
        served.runner.generate(request.pop("input_ids", served.prompts), **request)
    assert _stats(served.handle) == before  # refused before the prefill
    assert torch.equal(served.runner.generate(served.prompts, max_new_tokens=NEW), served.baseline)


# --- finding 1: a pad id outside the vocabulary (it used to fail in the embedding, mid-decode)


@pytest.mark.parametrize("pad", [-1, VOCAB, 10**6])
def test_pad_token_outside_the_vocabulary(served, pad):
    _refused(served, ValueError, rf"pad_token_id must be in \[0, {VOCAB}\) \(the model's vocabulary\), got {pad}",
             eos_token_id=EOS, pad_token_id=pad)  # fmt: skip


def test_pad_token_that_is_not_an_int(served):
    _refused(served, TypeError, "pad_token_id must be a token id", eos_token_id=EOS, pad_token_id=5.7)
    _refused(served, TypeError, "pad_token_id must be a token id", eos_token_id=EOS, pad_token_id=[5])


def test_pad_token_out_of_range_without_eos(served):
    _refused(served, ValueError, "pad_token_id must be in", pad_token_id=-1)


def test_good_eos_and_pad_still_run(served):
    out = served.runner.generate(served.prompts, max_new_tokens=NEW, eos_token_id=(served.eos,), pad_token_id=0)
    assert out[0, PROMPT + 1 :].tolist() == [0] * (NEW - 1)  # row 0 finished, padded
    assert torch.equal(out[1], served.baseline[1])
    numpy_ids = served.runner.generate(
        served.prompts, max_new_tokens=NEW, eos_token_id=[np.int64(served.eos)], pad_token_id=np.int32(0)
    )
    assert torch.equal(numpy_ids, out)


# --- finding 2: unclear errors become a TypeError / ValueError naming the argument


@pytest.mark.parametrize(
    "eos, error, match",
    [
        ([], ValueError, "eos_token_id must name at least one token id, got an empty list"),
        ((), ValueError, "eos_token_id must name at least one token id, got an empty tuple"),
        ("3", TypeError, "eos_token_id must be a token id .* got str '3'"),
        (2.5, TypeError, "eos_token_id must be a token id .* got float 2.5"),  # it never matched a token
        (True, TypeError, "eos_token_id must be a token id"),
        ([3, None], TypeError, "eos_token_id must be a token id"),
        (VOCAB, ValueError, rf"eos_token_id must be in \[0, {VOCAB}\)"),
        ([3, -1], ValueError, rf"eos_token_id must be in \[0, {VOCAB}\) .*got -1"),
    ],
)
def test_bad_eos_token_id(served, eos, error, match):
    _refused(served, error, match, eos_token_id=eos)


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"temperature": "0.7"}, TypeError, "temperature must be a number, got str '0.7'"),
        ({"temperature": torch.tensor(0.5)}, TypeError, "temperature must be a number"),
        ({"temperature": float("inf")}, ValueError, "temperature must be > 0 and finite, got inf"),  # uniform samples
        ({"temperature": float("nan")}, ValueError, "temperature must be > 0 and finite"),
        ({"temperature": 0}, ValueError, "temperature must be > 0"),
        ({"top_p": "0.9"}, TypeError, "top_p must be a number"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"generator": 0}, TypeError, "generator must be a torch.Generator or None, got int"),
    ],
)
def test_bad_sampling_settings(served, options, error, match):
    _refused(served, error, match, do_sample=True, **options)


@pytest.mark.parametrize(
    "mask, error, match",
    [
        ([[1] * PROMPT] * 2, TypeError, "attention_mask must be a dense .* got list"),
        (torch.ones(2, PROMPT + 1, dtype=torch.long), ValueError, "attention_mask must be shaped like input_ids"),
        (torch.ones(2, PROMPT, dtype=torch.long).to_sparse(), TypeError, "attention_mask must be a dense"),
    ],
)
def test_attention_mask_of_the_wrong_kind(served, mask, error, match):
    _refused(served, error, match, attention_mask=mask)


def test_model_that_is_not_a_model(served):
    for model, match in [
        (None, "model must be a transformers causal LM .* got NoneType"),
        (served.handle, "got ExpertCacheHandle: pass the model itself"),
        ("qwen3_moe", "got str"),
    ]:
        with pytest.raises(TypeError, match=match):
            GraphedGenerator(model, max_length=32, graphs=False)
    assert torch.equal(served.runner.generate(served.prompts, max_new_tokens=NEW), served.baseline)


# --- finding 3: flags are bools


@pytest.mark.parametrize("graphs", [1, 0, 1.0, None, np.bool_(True), torch.tensor(True)])
def test_graphs_must_be_a_bool_or_auto(served, graphs):
    before = _stats(served.handle)
    with pytest.raises(TypeError, match="graphs must be True, False or 'auto', got "):
        GraphedGenerator(served.model, max_length=32, graphs=graphs)
    assert _stats(served.handle) == before
    assert not GraphedGenerator(served.model, max_length=32, graphs=False).graphs  # a real bool still works


@pytest.mark.parametrize("do_sample", ["no", 1, 0, None, np.bool_(False)])
def test_do_sample_must_be_a_bool(served, do_sample):
    _refused(served, TypeError, "do_sample must be True or False, got ", do_sample=do_sample)


# --- finding 4: settings the call would not use are refused, not ignored


@pytest.mark.parametrize(
    "options, match",
    [
        ({"temperature": 0.01}, "temperature=0.01 given with do_sample=False"),
        ({"top_p": 0.5}, "top_p=0.5 given with do_sample=False"),
        ({"generator": torch.Generator().manual_seed(0)}, "generator given with do_sample=False"),
        ({"temperature": 0.5, "top_p": 0.9}, "temperature=0.5, top_p=0.9 given with do_sample=False, .* drop them"),
    ],
)
def test_sampling_settings_without_do_sample(served, options, match):
    _refused(served, ValueError, match, **options)


def test_sampling_defaults_given_explicitly_are_fine(served):
    out = served.runner.generate(served.prompts, max_new_tokens=NEW, do_sample=False, temperature=1.0, top_p=1)
    assert torch.equal(out, served.baseline)


# --- finding 5: the attention mask's values, and bucket_for's batch


@pytest.mark.parametrize(
    "row, error, match",
    [
        ([0.5] * PROMPT, TypeError, "attention_mask must hold integers or bools .* got torch.float32"),  # was cut to 0
        ([2] * PROMPT, ValueError, r"attention_mask must hold only 0 \(padding\) and 1 \(token\), got \[2\]"),
        ([-1] + [1] * (PROMPT - 1), ValueError, r"only 0 \(padding\) and 1 \(token\), got \[-1\]"),
        ([0] * PROMPT, ValueError, "attention_mask row 1 has no token"),
        ([1] * (PROMPT - 2) + [0, 0], ValueError, "attention_mask row 1 ends with padding: .* left-padded"),
    ],
)
def test_attention_mask_values(served, row, error, match):
    dtype = torch.float32 if isinstance(row[0], float) else torch.long
    mask = torch.tensor([[1] * PROMPT, row], dtype=dtype)
    _refused(served, error, match, attention_mask=mask)


def test_good_masks_still_run(served):
    for dtype in (torch.bool, torch.int32, torch.uint8):
        mask = torch.ones(2, PROMPT, dtype=dtype)
        assert torch.equal(
            served.runner.generate(served.prompts, max_new_tokens=NEW, attention_mask=mask), served.baseline
        )
    left = torch.ones(2, PROMPT, dtype=torch.long)
    left[1, :2] = 0  # left padding: accepted
    assert served.runner.generate(served.prompts, max_new_tokens=NEW, attention_mask=left).shape == (2, PROMPT + NEW)


@pytest.mark.parametrize(
    "batch, error, match",
    [
        (0, ValueError, "batch must be >= 1, got 0"),
        (-1, ValueError, "batch must be >= 1, got -1"),
        (1.5, TypeError, "batch must be an int, got float 1.5"),
        (True, TypeError, "batch must be an int, got bool"),
        (3, ValueError, "batch 3 exceeds max_batch_size 2"),
    ],
)
def test_bucket_for_refuses_a_batch_that_is_not_one(served, batch, error, match):
    with pytest.raises(error, match=match):
        served.runner.bucket_for(batch)
    with pytest.raises(error, match=match):
        served.runner.eager_step(batch)
    assert served.runner.bucket_for(np.int64(2)) == 2


# --- finding 6: max_length within the model's positions


def test_max_length_beyond_the_models_positions(served):
    before = _stats(served.handle)
    with pytest.raises(ValueError, match=r"max_length 100000 is more than the model's max_position_embeddings \(512\)"):
        GraphedGenerator(served.model, max_length=100_000, graphs=False)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        GraphedGenerator(served.model, max_length=513, graphs=False)
    assert GraphedGenerator(served.model, max_length=512, graphs=False).max_length == 512
    assert _stats(served.handle) == before
    assert torch.equal(served.runner.generate(served.prompts, max_new_tokens=NEW), served.baseline)


# --- findings 7-9: enable_expert_cache's device and recorder


def _parameters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _unchanged(model, parameters, implementation) -> bool:
    now = dict(model.named_parameters())
    same = set(now) == set(parameters) and all(torch.equal(now[n].detach(), parameters[n]) for n in parameters)
    return same and dict(model.get_experts_implementation()) == implementation


def _tokens(model):
    return greedy_generate(model, prompt(8), 4).tokens


@pytest.mark.parametrize("device", ["cpu:1", torch.device("cpu", 1)])
def test_enable_refuses_a_cpu_that_does_not_exist(device):
    model = tiny_model("qwen3_moe")
    parameters, implementation, tokens = _parameters(model), dict(model.get_experts_implementation()), _tokens(model)
    with pytest.raises(ValueError, match="device 'cpu:1': there is one CPU device"):
        enable_expert_cache(model, cache_size=4, device=device)
    assert _unchanged(model, parameters, implementation)
    assert torch.equal(_tokens(model), tokens)
    handle = enable_expert_cache(model, cache_size=4, device="cpu:0")  # the one CPU, however spelt
    assert handle.config.device == "cpu"
    assert torch.equal(_tokens(model), tokens)
    handle.disable()


@pytest.mark.parametrize("recorder", [object(), "trace.npz", [RoutingRecorder()]])
def test_enable_refuses_a_recorder_that_is_not_one(recorder):
    model = tiny_model("qwen3_moe")
    parameters, implementation, tokens = _parameters(model), dict(model.get_experts_implementation()), _tokens(model)
    with pytest.raises(TypeError, match=r"recorder must be an expertcache\.trace\.RoutingRecorder or None, got "):
        enable_expert_cache(model, cache_size=4, recorder=recorder)
    assert _unchanged(model, parameters, implementation)
    assert torch.equal(_tokens(model), tokens)


def test_one_recorder_records_one_served_model():
    first, second = tiny_model("qwen3_moe"), tiny_model("mixtral")
    recorder = RoutingRecorder()
    handle = enable_expert_cache(first, cache_size=4, recorder=recorder)
    tokens = _tokens(first)
    trace, stats = recorder.trace(), _stats(handle)
    parameters, implementation = _parameters(second), dict(second.get_experts_implementation())
    with pytest.raises(
        ValueError, match=r"already records another served model \(qwen3_moe\).* its own RoutingRecorder"
    ):
        enable_expert_cache(second, cache_size=4, recorder=recorder)
    assert _unchanged(second, parameters, implementation)
    assert _stats(handle) == stats
    assert recorder.model == "qwen3_moe"
    assert np.array_equal(recorder.trace().expert_ids, trace.expert_ids)
    forwards = recorder.num_forwards
    assert torch.equal(_tokens(first), tokens)  # still served, still recorded
    assert recorder.num_forwards > forwards
    other = enable_expert_cache(second, cache_size=4, recorder=RoutingRecorder())  # its own recorder: fine
    other.disable()
    handle.disable()
    again = enable_expert_cache(first, cache_size=4, recorder=recorder)  # no longer served elsewhere
    assert torch.equal(_tokens(first), tokens)
    again.disable()


def test_a_refused_enable_leaves_the_recorder_undescribed():
    model = tiny_model("qwen3_moe")  # fp32 experts: exponent coding refuses them, late in enabling
    recorder = RoutingRecorder()
    with pytest.raises(ValueError, match="compression='exponent'"):
        enable_expert_cache(model, cache_size=4, compression="exponent", recorder=recorder)
    assert recorder.layers is None and recorder.num_experts is None and recorder.model == ""
    other = tiny_model("deepseek_v3")  # other layers (a dense first one): the recorder still takes it
    handle = enable_expert_cache(other, cache_size=4, recorder=recorder)
    assert recorder.model == "deepseek_v3"
    handle.disable()


@pytest.mark.gpu
def test_a_sampling_generator_on_another_device():
    model = tiny_model("qwen3_moe", device="cuda")
    runner = GraphedGenerator(model, max_length=32, graphs=False)
    prompts = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3)).cuda()
    with pytest.raises(
        ValueError, match="generator is on cpu, the model on cuda"
    ):  # multinomial raised after the prefill
        runner.generate(prompts, max_new_tokens=NEW, do_sample=True, generator=torch.Generator())
    sampled = runner.generate(prompts, max_new_tokens=NEW, do_sample=True, generator=torch.Generator("cuda"))
    assert sampled.shape == (1, PROMPT + NEW)
