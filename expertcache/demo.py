"""The embedded default job: a scaled-down transformers MoE model served through the cache.

No download: a Qwen3-MoE-shaped model (or another family) is built from transformers' own
config class with random weights. It generates greedily without the cache, then with the
cache at several sizes and both budgets, on the GPU if there is one (bf16), else the CPU
(fp32), and prints for each run whether the tokens equal the uncached run's, the hit rate,
the bytes copied host -> device, the expert bytes the device holds against fully resident,
the measured peak device memory (CUDA only) and the time. One run records its routing into
a `RoutingTrace`, which is saved as ``.npz`` and read back. On a GPU it then decodes again
with `GraphedGenerator` (each step one CUDA-graph replay), all experts resident and with the
device-mode cache inside the graph, and checks those tokens against the first run's too.

Random weights route almost uniformly: the hit rates here are a worst case.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from expertcache.integrations.transformers.generation import GenerationRun, greedy_generate
from expertcache.integrations.transformers.graphed import GraphedGenerator, timed_generate
from expertcache.integrations.transformers.handle import enable_expert_cache
from expertcache.integrations.transformers.random_models import FAMILIES, ModelSizes, random_model
from expertcache.stats import CacheStats
from expertcache.trace.format import RoutingTrace
from expertcache.trace.recorder import RoutingRecorder
from expertcache.validation import check_int, resolve_device

#: The demo model: Qwen3-30B-A3B's routing shape (top-8 of many experts), scaled down.
DEMO_SIZES = ModelSizes(
    num_moe_layers=6, num_experts=64, top_k=8, hidden=256, intermediate=128, vocab=4096, head_dim=64
)


@dataclass(frozen=True)
class DemoRow:
    """One generation of the demo (``cache_size`` None: every expert resident)."""

    label: str
    run: GenerationRun
    identical: bool
    hit_rate: float | None
    bytes_copied: int
    expert_bytes_on_device: int


def run_demo(
    *,
    family: str = "qwen3_moe",
    device: str | None = None,
    new_tokens: int = 32,
    prompt_tokens: int = 24,
    sizes: ModelSizes = DEMO_SIZES,
    trace_path: Path | None = None,
    graphs: bool | None = None,
) -> list[DemoRow]:
    """Generate without and with the cache, print the table and the trace check.

    Args:
        family: model family (`expertcache.integrations.transformers.random_models`).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (default: CUDA if present).
        new_tokens: tokens to generate, at least 1.
        prompt_tokens: prompt length, at least 1.
        sizes: the model's sizes.
        trace_path: keep the recorded trace in exactly this file (its folder must exist).
        graphs: add the `GraphedGenerator` runs (default: on CUDA; True on the CPU raises).

    Returns:
        The table's rows (the first is the uncached run).

    Raises:
        ValueError / TypeError: any argument out of range, checked before a model is built.
    """
    target = _check_arguments(family, device, new_tokens, prompt_tokens, trace_path)
    if graphs is None:
        graphs = target.type == "cuda"
    if graphs and target.type != "cuda":
        raise ValueError(f"graphs=True needs a CUDA device, the demo runs on {target}")
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    model = random_model(family, sizes, dtype=dtype).to(target)
    if target.type == "cuda":
        # generate() swaps grouped_mm for batched_mm while decoding on GPUs, which the cache
        # cannot see; fixing batched_mm makes both runs the same computation.
        model.set_experts_implementation("batched_mm")
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, sizes.vocab, (1, prompt_tokens), generator=generator).to(target)
    _print_header(family, sizes, target, dtype, prompt_tokens, new_tokens)
    greedy_generate(model, prompt, 2)  # warm-up: first-call costs stay out of the timings
    baseline = greedy_generate(model, prompt, new_tokens, progress="no cache")
    rows = [DemoRow("all experts resident", baseline, True, None, 0, baseline_expert_bytes(model))]
    recorder = RoutingRecorder(source="expertcache demo")
    E = sizes.num_experts
    settings = [(E // 4, "global"), (E // 2, "global"), (E // 2, "per-layer"), (E, "global")]
    for cache_size, budget in settings:
        record = recorder if (cache_size, budget) == (E // 2, "global") else None
        label = f"{budget} {cache_size}/{E}"
        handle = enable_expert_cache(model, cache_size=cache_size, budget=budget, recorder=record)
        rows.append(_cached_run(handle, model, prompt, new_tokens, label, baseline))
    if graphs:  # device-mode caches: admission, copies and remap inside the graph
        graphed: list[tuple[int | None, str]] = [(None, ""), (E // 4, "global"), (E // 2, "per-layer")]
        for slots, budget in graphed:
            label = "graphed, all resident" if slots is None else f"graphed {budget} {slots}/{E}"
            rows.append(_graphed_run(model, prompt, new_tokens, baseline, slots, budget, label))
    _print_table(rows)
    _check_trace(recorder, trace_path, rows[0].run)
    _print_routing_spread(recorder.trace(), prompt_tokens)
    return rows


def _check_arguments(family, device, new_tokens, prompt_tokens, trace_path) -> torch.device:
    """The device to run on, after checking every argument of `run_demo`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    for name, value in (("new_tokens", new_tokens), ("prompt_tokens", prompt_tokens)):
        check_int(name, value, minimum=1)
    if trace_path is not None:
        path = Path(trace_path)
        if path.is_dir() or not path.parent.is_dir():
            raise ValueError(f"trace_path {path}: a directory, or a folder that does not exist")
    target = resolve_device(device)
    return torch.device("cpu") if target.type == "cpu" else target


def _cached_run(handle, model, prompt, new_tokens, label, baseline) -> DemoRow:
    if handle.recorder is not None:
        handle.recorder.begin_request()
    try:
        run = greedy_generate(model, prompt, new_tokens, progress=label)
        stats = handle.stats.total
        slot_bytes = handle.slot_bytes
    finally:
        handle.disable()
    identical = bool(torch.equal(run.tokens, baseline.tokens))
    return DemoRow(label, run, identical, stats.hit_rate, stats.bytes_h2d, slot_bytes)


def _graphed_run(model, prompt, new_tokens, baseline, cache_size: int | None, budget: str, label: str) -> DemoRow:
    """A `GraphedGenerator` run; with a cache, device mode (its admission is in the graph)."""
    handle = None
    if cache_size is not None:
        handle = enable_expert_cache(model, cache_size=cache_size, budget=budget, mode="device")
    try:
        runner = GraphedGenerator(model, max_length=prompt.shape[1] + new_tokens, graphs=True)
        runner.generate(prompt, max_new_tokens=min(new_tokens, runner.warmup_steps + 2))  # warm-up, capture
        before = CacheStats() if handle is None else handle.stats.total
        run = timed_generate(runner, prompt, new_tokens)
        del runner  # the graphs hold the slots' addresses: gone before disable()
        identical = bool(torch.equal(run.tokens, baseline.tokens))
        if handle is None:
            return DemoRow(label, run, identical, None, 0, baseline_expert_bytes(model))
        stats = _since(handle.stats.total, before)
        return DemoRow(label, run, identical, stats.hit_rate, stats.bytes_h2d, handle.slot_bytes)
    finally:
        if handle is not None:
            handle.disable()


def baseline_expert_bytes(model) -> int:
    """Bytes of the expert parameters when every expert is resident."""
    return sum(p.nbytes for n, p in model.named_parameters() if ".experts." in n)


def _since(after: CacheStats, before: CacheStats) -> CacheStats:
    names = [field.name for field in dataclasses.fields(CacheStats)]
    return CacheStats(**{name: getattr(after, name) - getattr(before, name) for name in names})


def _print_header(family, sizes: ModelSizes, target, dtype, prompt_tokens, new_tokens) -> None:
    print(
        f"expertcache demo: random {family} model, {sizes.num_moe_layers} MoE layers x "
        f"{sizes.num_experts} experts, top-{sizes.top_k}, hidden {sizes.hidden}, expert "
        f"intermediate {sizes.intermediate}; {str(dtype).removeprefix('torch.')} on {target}"
    )
    print(
        f"greedy generation: {prompt_tokens} prompt tokens + {new_tokens} new tokens; random "
        f"weights route almost uniformly, so these hit rates are a worst case"
    )


def _print_table(rows: list[DemoRow]) -> None:
    header = (
        f"{'cache (budget slots/layer)':<28} {'tokens ==':>9} {'hit rate':>8} {'MB copied':>9} "
        f"{'expert MB on device':>19} {'peak MB':>8} {'time s':>7} {'tok/s':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        hit = "-" if row.hit_rate is None else f"{row.hit_rate:.1%}"
        peak = "n/a" if row.run.peak_bytes is None else f"{row.run.peak_bytes / 1e6:.1f}"
        print(
            f"{row.label:<28} {'yes' if row.identical else 'NO':>9} {hit:>8} "
            f"{row.bytes_copied / 1e6:>9.1f} {row.expert_bytes_on_device / 1e6:>19.1f} "
            f"{peak:>8} {row.run.seconds:>7.2f} {row.run.tokens_per_second:>7.1f}"
        )
    print("(peak MB: torch.cuda.max_memory_allocated during the run, whole model; n/a on CPU)")
    if any(row.label.startswith("graphed") for row in rows):
        print("(graphed: GraphedGenerator, one CUDA-graph replay per token; caches in device mode)")


def _check_trace(recorder: RoutingRecorder, path: Path | None, baseline: GenerationRun) -> None:
    trace = recorder.trace()
    with tempfile.TemporaryDirectory() as scratch:
        target = trace.save(path or Path(scratch) / "demo_trace.npz")
        loaded = RoutingTrace.load(target)
        size = target.stat().st_size
    same = (
        np.array_equal(loaded.expert_ids, trace.expert_ids)
        and np.array_equal(loaded.forward_starts, trace.forward_starts)
        and np.array_equal(loaded.request_starts, trace.request_starts)
        and np.array_equal(np.asarray(loaded.layers), np.asarray(trace.layers))
    )
    expected_tokens = baseline.tokens.shape[1] - 1  # the last token is never fed back
    print(
        f"routing trace of the 'global' 50% run: {trace.num_tokens} tokens x {trace.num_layers} "
        f"layers x top-{trace.top_k}, {trace.num_forwards} forwards (expected "
        f"{expected_tokens} tokens); saved as .npz ({size} bytes"
        f"{', ' + str(target) if path else ''}) and read back: {'identical' if same else 'DIFFERENT'}"
    )


def _print_routing_spread(trace: RoutingTrace, prompt_tokens: int) -> None:
    """How close to uniform the decode steps routed: distinct experts used per layer."""
    decode = trace.expert_ids[prompt_tokens:]
    steps, top_k, experts = decode.shape[0], trace.top_k, trace.num_experts
    used = np.mean([np.unique(decode[:, column]).size for column in range(trace.num_layers)])
    uniform = experts * (1 - (1 - top_k / experts) ** steps)
    print(
        f"decode routing: {used:.1f} of {experts} experts used per layer over {steps} steps "
        f"(uniform routing would use {uniform:.1f} on average)"
    )
