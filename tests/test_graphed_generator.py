"""`GraphedGenerator`: the StaticCache decode runner, eager on the CPU, graphed on a GPU.

On the CPU the runner takes its eager path (the same buffers, cache and step a graph
captures) and must give ``model.generate``'s tokens for every family, with and without the
cache. Whether the captured step is free of host reads is checked on the CPU with fake
tensors (a data-dependent op such as ``nonzero`` or ``.item()`` raises there as it would
abort a capture); the graphs themselves run in the ``gpu`` tests at the end.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import types

import pytest
import torch
from helpers import BENCHMARKS, bench_module, traces_env
from transformers_helpers import TINY, tiny_model

from expertcache.cli import main
from expertcache.integrations.transformers import enable_expert_cache
from expertcache.integrations.transformers.decode_setup import (
    choose_tokens,
    decode_experts_implementation,
    resolve_graphs,
    static_cache,
)
from expertcache.integrations.transformers.generation import greedy_generate
from expertcache.integrations.transformers.graphed import GraphedGenerator, bucket_sizes
from expertcache.integrations.transformers.random_models import FAMILIES
from expertcache.kernels._launch import INTERPRETED

NEW = 12
MAX_LENGTH = 40


def _prompts(batch: int, length: int = 10, *, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab, (batch, length), generator=generator)


def _reference(model, input_ids, attention_mask=None, **options) -> torch.Tensor:
    """``model.generate``'s greedy tokens (exactly NEW new tokens unless EOS ids are given)."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if "eos_token_id" not in options:
        options = {**options, "min_new_tokens": NEW, "pad_token_id": 0}
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **options)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", [None, "host"])
def test_eager_runner_matches_generate(family, cache):
    model = tiny_model(family)
    first, second = _prompts(1), _prompts(1, 7, seed=8)
    expected = [_reference(model, first), _reference(model, second)]
    handle = enable_expert_cache(model, cache_size=4, mode=cache) if cache else None
    runner = GraphedGenerator(model, max_length=MAX_LENGTH)
    assert not runner.graphs  # "auto" on the CPU
    # the second call reuses the bucket's static cache: reset in place, not stale
    assert torch.equal(runner.generate(first, max_new_tokens=NEW), expected[0])
    assert torch.equal(runner.generate(second, max_new_tokens=NEW), expected[1])
    if handle is not None:
        assert handle.stats.total.misses > 0  # the experts really came through the cache
        handle.disable()


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_in_a_larger_bucket(family):
    """3 sequences (one left-padded) run in bucket 4, the 4th row a copy of the first."""
    model = tiny_model(family)
    prompts = _prompts(3)
    mask = torch.ones_like(prompts)
    mask[1, :4] = 0
    prompts[1, :4] = 0
    runner = GraphedGenerator(model, max_length=MAX_LENGTH, max_batch_size=4)
    assert runner.bucket_for(3) == 4
    out = runner.generate(prompts, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(out, _reference(model, prompts, mask))


@pytest.mark.skipif(not INTERPRETED, reason="device mode on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_device_mode_cache_in_the_eager_path(family):
    model = tiny_model(family)
    prompts = _prompts(2)
    expected = _reference(model, prompts)
    handle = enable_expert_cache(model, cache_size=4, mode="device")
    runner = GraphedGenerator(model, max_length=MAX_LENGTH, max_batch_size=2)
    assert torch.equal(runner.generate(prompts, max_new_tokens=NEW), expected)
    assert handle.stats.total.misses > 0
    handle.disable()


def _step_on_fake_tensors(model) -> torch.Tensor:
    """Prefill for real, then run the decode step (what a graph captures) on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    runner = GraphedGenerator(model, max_length=MAX_LENGTH)
    with pytest.raises(ValueError, match="has not run yet"):
        runner.eager_step(1)
    runner.generate(_prompts(1), max_new_tokens=2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        return runner.eager_step(1)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_has_no_data_dependent_op(family):
    """Attention, masks, rotary, router and StaticCache update: static shapes, no host read
    (the experts through batched_mm, which the cache's inner implementation may be)."""
    model = tiny_model(family)
    model.set_experts_implementation("batched_mm")
    logits = _step_on_fake_tensors(model)  # raises on a data-dependent op
    assert logits.shape == (1, TINY.vocab)


def test_fake_step_catches_the_eager_experts_nonzero():
    """The check above has teeth: transformers' eager experts call nonzero (not capturable)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    model = tiny_model("qwen3_moe")
    model.set_experts_implementation("eager")
    with pytest.raises(DynamicOutputShapeException):
        _step_on_fake_tensors(model)


def test_sliding_window_layers():
    model = tiny_model("gpt_oss")  # layers: sliding (window 128), full
    cache = static_cache(model, MAX_LENGTH)
    # a window that never slides becomes a static layer: its length lives on the device
    assert cache.is_sliding == [False, False]
    model.config.sliding_window = 8
    with pytest.raises(ValueError, match="sliding window of 8 tokens"):
        static_cache(model, MAX_LENGTH)
    assert static_cache(model, MAX_LENGTH, keep_sliding=True).is_sliding == [True, False]


def test_a_short_sliding_window_in_the_eager_path():
    model = tiny_model("gpt_oss")
    model.config.sliding_window = 8  # shorter than prompt + new tokens: the window slides
    for layer in model.model.layers:
        if layer.self_attn.sliding_window:
            layer.self_attn.sliding_window = 8
    runner = GraphedGenerator(model, max_length=MAX_LENGTH)
    assert torch.equal(runner.generate(_prompts(1), max_new_tokens=NEW), _reference(model, _prompts(1)))


def test_eos_stops_like_generate():
    model = tiny_model("qwen3_moe")
    greedy = _reference(model, _prompts(1))
    eos = int(greedy[0, 10 + 4])  # the 5th new token (first time it appears, checked below)
    assert eos not in greedy[0, 10 : 10 + 4].tolist()
    runner = GraphedGenerator(model, max_length=MAX_LENGTH, max_batch_size=2)
    out = runner.generate(_prompts(1), max_new_tokens=NEW, eos_token_id=eos)
    assert out.shape == (1, 10 + 5)  # stopped right after EOS
    assert torch.equal(out, _reference(model, _prompts(1), eos_token_id=eos, pad_token_id=eos))
    # a batch: finished rows emit the pad token until every row is done (or NEW tokens)
    batch = torch.cat([_prompts(1), _prompts(1, seed=3)])
    expected = _reference(model, batch, eos_token_id=[eos, 5], pad_token_id=99)
    assert torch.equal(runner.generate(batch, max_new_tokens=NEW, eos_token_id=[eos, 5], pad_token_id=99), expected)
    assert (expected == 99).any()  # the case covered: a finished row padded


def test_sampling_is_seeded_and_tiny_top_p_is_greedy():
    model = tiny_model("mixtral")
    runner = GraphedGenerator(model, max_length=MAX_LENGTH)

    def sample(seed, **options):
        generator = torch.Generator().manual_seed(seed)
        return runner.generate(_prompts(1), max_new_tokens=NEW, do_sample=True, generator=generator, **options)

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))  # random weights: near-uniform next tokens
    assert torch.equal(sample(3, top_p=1e-6), _reference(model, _prompts(1)))
    assert torch.equal(sample(3, temperature=1e-4), _reference(model, _prompts(1)))


def test_top_p_keeps_the_nucleus_only():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (0.5 < 0.7 <= 0.8)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(4000, -1)
    generator = torch.Generator().manual_seed(0)
    tokens = choose_tokens(logits, do_sample=True, top_p=0.7, generator=generator)
    assert set(tokens.tolist()) == {0, 1}
    share = (tokens == 0).float().mean().item()
    assert 0.58 < share < 0.67  # renormalised: 0.5 / 0.8 = 0.625
    assert choose_tokens(torch.tensor([[1.0, 3.0, 3.0]])).tolist() == [1]  # first of ties, like argmax


def test_graphs_are_refused_where_they_cannot_run():
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        GraphedGenerator(model, max_length=MAX_LENGTH, graphs=True)
    with pytest.raises(ValueError, match="graphs must be True, False or 'auto'"):
        GraphedGenerator(model, max_length=MAX_LENGTH, graphs="yes")
    cuda = torch.device("cuda")  # the decision only, no CUDA needed
    assert resolve_graphs(model, "auto", cuda) and resolve_graphs(model, True, cuda)
    handle = enable_expert_cache(model, cache_size=4, mode="host")
    with pytest.raises(ValueError, match="host-mode expert cache"):
        resolve_graphs(model, True, cuda)
    assert resolve_graphs(model, "auto", cuda) is False  # auto falls back to the eager path
    handle.disable()
    assert resolve_graphs(model, True, cuda)


@pytest.mark.skipif(not INTERPRETED, reason="device mode on the CPU needs TRITON_INTERPRET=1")
def test_a_routing_recorder_cannot_be_captured():
    from expertcache.trace import RoutingRecorder

    model = tiny_model("qwen3_moe")
    handle = enable_expert_cache(model, cache_size=4, mode="device", recorder=RoutingRecorder())
    with pytest.raises(ValueError, match="RoutingRecorder copies"):
        resolve_graphs(model, True, torch.device("cuda"))
    handle.disable()


@pytest.mark.skipif(not INTERPRETED, reason="device mode on the CPU needs TRITON_INTERPRET=1")
def test_device_mode_cache_may_be_captured():
    model = tiny_model("qwen3_moe")
    handle = enable_expert_cache(model, cache_size=4, mode="device")
    assert resolve_graphs(model, True, torch.device("cuda"))
    handle.disable()


def test_requests_are_checked():
    model = tiny_model("olmoe")
    runner = GraphedGenerator(model, max_length=20, max_batch_size=2)
    with pytest.raises(ValueError, match="exceeds max_length 20"):
        runner.generate(_prompts(1, 15), max_new_tokens=6)
    with pytest.raises(ValueError, match=r"batch must be in \[1, 2\]"):
        runner.generate(_prompts(3), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        runner.generate(_prompts(1), max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        runner.generate(_prompts(1), max_new_tokens=2, do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        runner.generate(_prompts(1).clamp(max=0) - 1, max_new_tokens=2)
    with pytest.raises(ValueError, match="the model's vocabulary"):
        runner.generate(_prompts(1) + model.get_input_embeddings().num_embeddings, max_new_tokens=2)
    assert torch.equal(runner.generate(_prompts(1), max_new_tokens=2), runner.generate(_prompts(1), max_new_tokens=2))
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        GraphedGenerator(model, max_length=0)


@pytest.mark.parametrize(
    "largest, buckets",
    [(1, (1,)), (2, (1, 2)), (4, (1, 2, 4)), (6, (1, 2, 4, 6)), (8, (1, 2, 4, 8))],  # 6: not a power of two
)
def test_bucket_sizes(largest, buckets):
    assert bucket_sizes(largest) == buckets


def test_decode_switches_grouped_mm_to_batched_mm_off_the_cpu_like_generate():
    model = tiny_model("qwen3_moe")
    assert model.get_experts_implementation()[""] == "grouped_mm"
    with decode_experts_implementation(model, torch.device("cpu")):
        assert model.get_experts_implementation()[""] == "grouped_mm"
    with decode_experts_implementation(model, torch.device("cuda")):  # only .type is read
        assert model.get_experts_implementation()[""] == "batched_mm"
    assert model.get_experts_implementation()[""] == "grouped_mm"


def test_generate_graphs_flag_needs_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    tiny_model("qwen2_moe").save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tmp_path), "--moe-expert-cache-size", "4", "--graphs", "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--graphs" in err[-1] and "CUDA" in err[-1]


def test_bench_generate_dry_run():
    """The benchmark's tiny CPU mode: every variant but accelerate, the trace routing, a table."""
    before = sorted((BENCHMARKS / "results").glob("*.csv"), key=str)
    stamps = [path.stat().st_mtime_ns for path in before]
    command = [sys.executable, str(BENCHMARKS / "bench_generate.py"), "--dry-run", "--trace", "--fractions", "0.25"]
    env = traces_env(tempfile.mkdtemp(prefix="traces_"))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=BENCHMARKS, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    table = done.stdout.split("tok/s: new tokens")[1]
    for variant in (
        "resident-eager",
        "resident-graphed",
        "resident-ttft",
        "cache-eager",
        "cache-graphed",
        "cache-ttft",
    ):
        assert variant in table
    assert table.count("True") == 9 and "same tokens: all runs" in done.stdout  # 3 resident + 2 budgets x 3
    assert [path.stat().st_mtime_ns for path in before] == stamps  # a dry run writes no CSV


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fractions", "2"], "a fraction of the experts, in (0, 1]"),
        (["--experts-format", "mxfp4", "--model", "qwen3-30b-a3b"], "mxfp4 needs a gpt_oss model"),
        (["--dry-run", "--variants", "accelerate"], "--dry-run has no accelerate variant"),
    ],
)
def test_bench_generate_bad_flags_exit_2_with_one_line(flags, message):
    command = [sys.executable, str(BENCHMARKS / "bench_generate.py"), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("bench_generate.py: error:") and message in last


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("graphed", [False, True])
def test_trace_routing_replaces_the_routers_choice(graphed, family):
    """Token t of a run is routed by trace row t mod N in every MoE layer (DeepSeek-V3's dense
    first layer has none), in the eager path of the runner as in generate; the cursor lives
    on the device (a graph replays it); the weights are the router's own scores at those ids."""
    from expertcache.integrations.transformers.random_models import ModelSizes, random_model

    bench = bench_module("bench_generate")
    model = random_model(family, ModelSizes(num_moe_layers=2, num_experts=16, top_k=4))
    generator = torch.Generator().manual_seed(0)
    trace = torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(5 * 3)]).view(5, 3, 4)
    routing = bench.TraceRouting(trace, torch.device("cpu"))
    routing.install(model)
    seen: list[list[torch.Tensor]] = [[], []]
    weights: list[torch.Tensor] = []
    blocks = [block for block in model.model.layers if hasattr(block.mlp, "experts")]
    assert len(blocks) == 2
    for layer, block in enumerate(blocks):
        block.mlp.experts.register_forward_hook(lambda module, args, out, layer=layer: seen[layer].append(args[1]))
    blocks[0].mlp.experts.register_forward_hook(lambda module, args, out: weights.append(args[2]))
    prompt = _prompts(1, 4)
    if graphed:
        GraphedGenerator(model, max_length=MAX_LENGTH).generate(prompt, max_new_tokens=4)
    else:
        _reference(model, prompt)
    for layer in range(2):
        ids = torch.cat(seen[layer])
        assert torch.equal(ids, trace[torch.arange(ids.shape[0]) % 5, layer])
    assert int(routing.cursor) == torch.cat(seen[0]).shape[0]  # prompt + one row per fed-back token
    gate = blocks[0].mlp.gate
    scale = getattr(gate, "routed_scaling_factor", 1.0)  # DeepSeek-V3 scales normalised sigmoid scores
    for step_weights in weights:
        sums = step_weights.sum(dim=-1).float()
        if gate.norm_topk_prob:
            torch.testing.assert_close(sums, torch.full_like(sums, scale))
        else:  # softmax probabilities of 4 of 16 experts
            assert bool(((sums > 0) & (sums < 1)).all())
    routing.reset()
    assert int(routing.cursor) == 0


# ---- on a GPU: the graphs themselves ---------------------------------------------------


def _gpu_model(family: str):
    model = tiny_model(family, dtype=torch.bfloat16, device="cuda")
    model.set_experts_implementation("batched_mm")  # what generate() decodes with on a GPU
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 4])
def test_graphed_device_mode_cache_matches_generate(family, batch):
    model = _gpu_model(family)
    prompts, again = _prompts(batch).cuda(), _prompts(batch, 8, seed=11).cuda()
    expected, expected_again = _reference(model, prompts), _reference(model, again)
    handle = enable_expert_cache(model, cache_size=4, mode="device")
    runner = GraphedGenerator(model, max_length=MAX_LENGTH, max_batch_size=4)
    assert runner.graphs
    assert torch.equal(runner.generate(prompts, max_new_tokens=NEW), expected)
    assert runner.captured_buckets == (batch,)
    assert runner.replays == NEW - 1 - runner.warmup_steps  # the steps after warm-up and capture
    # a second request replays the same graph (static cache reset in place)
    assert torch.equal(runner.generate(again, max_new_tokens=NEW), expected_again)
    assert runner.replays == (NEW - 1 - runner.warmup_steps) + (NEW - 1)
    assert handle.stats.total.misses > 0  # misses were served, inside the graph too
    del runner  # graphs hold the slots' addresses: dropped before disable()
    handle.disable()


@pytest.mark.gpu
def test_a_batch_padded_to_its_bucket():
    """3 sequences run in bucket 4: the rows equal generate() on the same 4 rows (a 4th copy of
    row 0), the computation the graph replays; a batch of 3 itself may pick other GEMM kernels."""
    model = _gpu_model("qwen3_moe")
    prompts = _prompts(3).cuda()
    expected = _reference(model, torch.cat([prompts, prompts[:1]]))[:3]
    handle = enable_expert_cache(model, cache_size=4, mode="device")
    runner = GraphedGenerator(model, max_length=MAX_LENGTH, max_batch_size=4)
    assert torch.equal(runner.generate(prompts, max_new_tokens=NEW), expected)
    assert runner.captured_buckets == (4,)
    del runner
    handle.disable()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_graphed_without_cache_matches_generate(family):
    model = tiny_model(family, dtype=torch.bfloat16, device="cuda")  # grouped_mm: switched for decode
    prompts = _prompts(2).cuda()
    runner = GraphedGenerator(model, max_length=MAX_LENGTH, max_batch_size=2)
    assert torch.equal(runner.generate(prompts, max_new_tokens=NEW), _reference(model, prompts))
    assert runner.captured_buckets == (2,)


@pytest.mark.gpu
def test_graphs_refuse_a_host_mode_cache_on_the_gpu():
    model = _gpu_model("qwen3_moe")
    handle = enable_expert_cache(model, cache_size=4, mode="host")
    with pytest.raises(ValueError, match="host-mode expert cache"):
        GraphedGenerator(model, max_length=MAX_LENGTH, graphs=True)
    runner = GraphedGenerator(model, max_length=MAX_LENGTH)  # auto: eager
    assert not runner.graphs
    handle.disable()


@pytest.mark.gpu
def test_generate_command_with_graphs_on_the_gpu(tmp_path, capsys):
    tiny_model("qwen2_moe").save_pretrained(tmp_path)
    base = ["generate", "--model", str(tmp_path), "--moe-expert-cache-size", "4", "--graphs", "--max-new-tokens", "8"]
    with pytest.raises(SystemExit) as exit_info:
        main(base)  # host mode, the default
    assert exit_info.value.code == 2
    assert "--moe-expert-cache-mode device" in capsys.readouterr().err
    status = main([*base, "--moe-expert-cache-mode", "device", "--prompt", "5 6 7 8", "--compare"])
    out = capsys.readouterr().out
    assert status == 0
    assert "CUDA graphs captured for batch bucket 1; 5 replays" in out  # 7 steps: 2 warm-up
    assert "without the cache: identical tokens" in out


@pytest.mark.gpu
def test_graphs_refuse_a_window_that_would_slide():
    model = _gpu_model("gpt_oss")
    model.config.sliding_window = 8
    with pytest.raises(ValueError, match="sliding window of 8 tokens"):
        GraphedGenerator(model, max_length=MAX_LENGTH)
    assert not GraphedGenerator(model, max_length=MAX_LENGTH, graphs=False).graphs


def test_bench_generate_times_both_calls_from_the_same_cache_state():
    """The decode speed is the difference of an N-token and a one-token call: both must start
    from the cache state an N-token call leaves (the warm-up's), or the difference counts the
    prefill's misses of one call and not the other's."""
    bench_generate = bench_module("bench_generate")
    model = tiny_model("qwen3_moe")
    tokens = _prompts(1)
    handle = enable_expert_cache(model, cache_size=3, budget="global")
    states = []

    def generate(new_tokens):
        states.append((new_tokens, tuple(tuple(handle.provider(layer).resident()) for layer in handle.layers)))
        return greedy_generate(model, tokens, new_tokens)

    args = types.SimpleNamespace(warmup_tokens=12, new_tokens=12)
    bench = types.SimpleNamespace(args=args, reset_routing=lambda: None)
    measured = bench_generate._measure(bench, generate, handle)
    assert [n for n, _ in states] == [12, 12, 1]
    assert states[1][1] == states[2][1] != states[0][1]  # after the warm-up; the empty cache differs
    assert measured.step_bytes is not None and measured.step_bytes >= 0
    handle.disable()


def test_bench_generate_prints_no_speed_from_a_negative_difference():
    """A tiny model on a CPU: the N-token call can take less time than the one-token call
    (noise); the step is then unresolved, not a negative speed or ratio."""
    bench_generate = bench_module("bench_generate")
    from expertcache.integrations.transformers.generation import GenerationRun

    tokens = torch.zeros(1, 4, dtype=torch.long)
    faster = bench_generate.Measured(GenerationRun(tokens, 12, 0.010, None), GenerationRun(tokens, 1, 0.012, None))
    slower = bench_generate.Measured(GenerationRun(tokens, 12, 0.023, None), GenerationRun(tokens, 1, 0.012, None))
    assert faster.step_seconds is None and slower.step_seconds == pytest.approx(0.001)
    rows = [
        {"variant": "resident-eager", "_step_s": None, "_step_bytes": None, "x_resident": "", "x_bound": ""},
        {"variant": "cache-eager", "_step_s": 0.002, "_step_bytes": 1e6, "x_resident": "", "x_bound": ""},
    ]
    bench_generate._ratios(rows, copy_gbps=50.0)
    assert rows[1]["x_resident"] == "" and rows[1]["x_bound"] == ""  # no resident step to divide by
