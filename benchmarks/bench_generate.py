"""Greedy decode speed and time to first token of a full-depth MoE model, served every way.

One model per process, random weights with a real model's expert shapes (small attention and
vocabulary, so memory is experts):

    qwen3-30b-a3b   48 layers x 128 experts of 2048 x 768, top-8, bf16 (9.4 MB per expert)
    gpt-oss-20b     24 layers x 32 experts of 2880 x 2880, top-4, bf16, with biases

Variants, side by side (``--variants`` picks some):

    resident-eager    every expert on the GPU, ``model.generate``
    resident-graphed  every expert on the GPU, `GraphedGenerator` (one CUDA-graph replay a token)
    cache-eager       the expert cache at each ``--fractions`` x ``--budgets``, ``model.generate``
    cache-graphed     the same device-mode cache inside `GraphedGenerator`'s graphs
    accelerate        accelerate offload (infer_auto_device_map + dispatch_model) at the GPU
                      budget of the smallest cache
    *-ttft            time to first token of a ``--ttft-tokens`` prompt: resident-ttft,
                      cache-ttft (each cache), accelerate-ttft (prefill is eager in every
                      variant, so graphed and eager share it)

Decode runs use ``--experts-implementation`` (batched_mm: what generate() decodes with on a
GPU, and the same computation everywhere, so the tokens must equal the resident run's; a
mismatch is reported). Prefill of the long TTFT prompt uses grouped_mm (batched_mm gathers
one weight copy per token and expert: 77 GB at 1024 x top-8 of Qwen3's experts); a served
model follows the switch, so one enable serves a cache's decode and TTFT runs, TTFT last (a
cache warmed by decoding, as in serving). Each decode run starts with a warm-up generation
(first calls, kernel compiles and graph capture stay out of the timing).

``--trace`` replays the real Qwen3-30B-A3B trace's routing (``../shared/traces``) through the
same model: every router's top-k ids are replaced by the trace's (cycled), read on the
device from a cursor the last MoE layer advances, so graphs replay it too. Without it random
weights route close to uniformly, a worst case for a cache.

Prints a table and appends one row per run, stamped with GPU name, versions and commit, to
``benchmarks/results/bench_generate.csv``. ``--dry-run``: a tiny model on the CPU in seconds
(graphed variants take the eager path, caches host mode, no accelerate, no CSV).

    python benchmarks/bench_generate.py --model qwen3-30b-a3b [--layers 48] [--trace]
    python benchmarks/bench_generate.py --model gpt-oss-20b --variants resident-eager cache-graphed
    python benchmarks/bench_generate.py --dry-run [--trace]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_csv, environment, print_table, traces_dir  # noqa: E402

from expertcache.integrations.transformers import enable_expert_cache  # noqa: E402
from expertcache.integrations.transformers.generation import GenerationRun, greedy_generate  # noqa: E402
from expertcache.integrations.transformers.graphed import GraphedGenerator, timed_generate  # noqa: E402
from expertcache.integrations.transformers.random_models import ModelSizes, random_model  # noqa: E402
from expertcache.stats import CacheStats  # noqa: E402

PRESETS = {
    "qwen3-30b-a3b": dict(family="qwen3_moe", layers=48, experts=128, top_k=8, hidden=2048, intermediate=768),
    "gpt-oss-20b": dict(family="gpt_oss", layers=24, experts=32, top_k=4, hidden=2880, intermediate=2880),
    # --dry-run: Qwen3's routing shape (so --trace works), tiny matrices
    "tiny": dict(family="qwen3_moe", layers=2, experts=128, top_k=8, hidden=32, intermediate=24),
}
VARIANTS = ("resident-eager", "resident-graphed", "resident-ttft", "cache-eager", "cache-graphed", "cache-ttft",
            "accelerate", "accelerate-ttft")  # fmt: skip
COLUMNS = ("variant", "budget", "slots", "tok_per_s", "ttft_s", "same_tokens", "hit_rate", "mb_copied",
           "expert_mb_gpu", "peak_mb")  # fmt: skip


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="MoE layers (default: the model's)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (kept small: memory is experts)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--ttft-tokens", type=int, default=1024)
    parser.add_argument("--accelerate-new-tokens", type=int, default=4, help="accelerate decodes ~0.1-1 tok/s")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--budgets", nargs="+", choices=("per-layer", "global"), default=["per-layer", "global"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument(
        "--eager-cache-mode",
        choices=("device", "host"),
        default="device",
        help="cache mode of cache-eager (device: the graphed run's cache, one enable for both)",
    )
    parser.add_argument("--experts-implementation", default="batched_mm", help="for every decode run")
    parser.add_argument("--trace", action="store_true", help="route by the real Qwen3-30B-A3B trace")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, no CSV")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    args = parser.parse_args()
    if args.dry_run:
        args.model, args.device = "tiny", args.device or "cpu"
        args.heads, args.head_dim, args.vocab = 4, 8, 128
        args.prompt_tokens, args.new_tokens, args.warmup_tokens, args.ttft_tokens = 6, 6, 3, 24
        args.variants = [v for v in args.variants if not v.startswith("accelerate")]
        args.eager_cache_mode = "host"
    args.device = torch.device(args.device or "cuda")
    for key, value in PRESETS[args.model].items():
        if getattr(args, key, None) is None:  # --layers overrides the preset's depth
            setattr(args, key, value)
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    if args.trace and (args.family, args.experts, args.top_k) != ("qwen3_moe", 128, 8):
        parser.error("--trace replays the Qwen3-30B-A3B trace: it needs a qwen3-30b-a3b-shaped model")
    if any(v.startswith("accelerate") for v in args.variants) and args.device.type != "cuda":
        parser.error("the accelerate variant offloads to a CUDA device")
    return args


class TraceRouting:
    """Every MoE layer routed by a recorded trace: ``[N, L, K]`` ids on the device, cycled.

    Token ``t`` of the run (prompt tokens first) takes trace row ``t mod N``; the router still
    computes its logits and the weights are its probabilities at the trace's ids (normalised
    as the model does), so everything but the choice of experts is the model's own.
    """

    def __init__(self, ids, device: torch.device) -> None:
        self.ids = torch.as_tensor(ids, dtype=torch.long, device=device)
        self.cursor = torch.zeros((), dtype=torch.long, device=device)  # next trace row

    def install(self, model) -> None:
        gates = [layer.mlp.gate for layer in model.model.layers]
        if len(gates) > self.ids.shape[1] or gates[0].num_experts <= int(self.ids.max()):
            raise ValueError(f"the trace ({tuple(self.ids.shape)}) does not fit this model's {len(gates)} layers")
        for layer, gate in enumerate(gates):
            gate.forward = functools.partial(self._route, gate, layer, layer == len(gates) - 1)

    def reset(self) -> None:
        self.cursor.zero_()  # in place: captured graphs read this tensor

    def _route(self, gate, layer: int, last: bool, hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, gate.hidden_dim)
        logits = F.linear(hidden, gate.weight)
        probs = logits.softmax(dim=-1, dtype=torch.float)
        rows = (self.cursor + torch.arange(hidden.shape[0], device=hidden.device)) % self.ids.shape[0]
        ids = self.ids[rows, layer]  # [T, K], gathered on the device: no host sync
        weights = probs.gather(1, ids)
        if gate.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if last:
            self.cursor.add_(hidden.shape[0])
        return logits, weights.to(logits.dtype), ids


@dataclasses.dataclass
class Bench:
    """The model, its prompts and what every run is compared with."""

    args: argparse.Namespace
    model: object
    prompt: torch.Tensor  # [batch, prompt_tokens]
    ttft_prompt: torch.Tensor  # [1, ttft_tokens]
    routing: TraceRouting | None
    expert_bytes: int
    reference: torch.Tensor | None = None  # decode tokens of the first resident run
    ttft_reference: torch.Tensor | None = None

    def reset_routing(self) -> None:
        if self.routing is not None:
            self.routing.reset()


def _build(args) -> Bench:
    sizes = ModelSizes(
        num_moe_layers=args.layers, num_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
        intermediate=args.intermediate, vocab=args.vocab, heads=args.heads, head_dim=args.head_dim,
    )  # fmt: skip
    model = random_model(args.family, sizes, dtype=args.dtype, device=args.device)
    model.set_experts_implementation(args.experts_implementation)
    routing = None
    if args.trace:
        from bench_decode import QWEN3_TRACE, qwen3_routing

        routing = TraceRouting(qwen3_routing(traces_dir() / QWEN3_TRACE, args.layers), args.device)
        routing.install(model)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt_tokens), generator=generator)
    ttft_prompt = torch.randint(0, args.vocab, (1, args.ttft_tokens), generator=generator)
    expert_bytes = sum(p.nbytes for n, p in model.named_parameters() if ".experts." in n)
    return Bench(args, model, prompt.to(args.device), ttft_prompt.to(args.device), routing, expert_bytes)


def _difference(after: CacheStats, before: CacheStats) -> CacheStats:
    names = [field.name for field in dataclasses.fields(CacheStats)]
    return CacheStats(**{name: getattr(after, name) - getattr(before, name) for name in names})


def _row(bench: Bench, variant: str, run: GenerationRun, *, handle=None, before=None, budget="", slots="") -> dict:
    """One decode or TTFT row; the tokens are checked against the first resident run's."""
    ttft = variant.endswith("ttft")
    if variant.startswith("resident"):  # the first resident run of each phase is the reference
        if ttft and bench.ttft_reference is None:
            bench.ttft_reference = run.tokens
        if not ttft and bench.reference is None:
            bench.reference = run.tokens
    reference = bench.ttft_reference if ttft else bench.reference
    if reference is not None:
        reference = reference[:, : run.tokens.shape[1]]  # accelerate makes fewer tokens
    same = "n/a" if reference is None else bool(torch.equal(run.tokens, reference))
    stats = None if handle is None else _difference(handle.stats.total, before)
    row = {
        "variant": variant, "budget": budget, "slots": slots,
        "tok_per_s": "" if ttft else round(run.tokens_per_second, 2),
        "ttft_s": round(run.seconds, 4) if ttft else "",
        "same_tokens": same,  # n/a: no resident run of this phase in this process
        "hit_rate": "" if stats is None else round(stats.hit_rate, 4),
        "mb_copied": "" if stats is None else round(stats.bytes_h2d / 1e6, 1),
        "expert_mb_gpu": round((bench.expert_bytes if handle is None else handle.slot_bytes) / 1e6, 1),
        "peak_mb": "" if run.peak_bytes is None else round(run.peak_bytes / 1e6, 1),
    }  # fmt: skip
    print(
        f"  {' '.join(map(str, (variant, budget, slots))).strip()}: "
        + ", ".join(f"{k} {row[k]}" for k in COLUMNS[3:] if row[k] != "")
    )
    return row


def _eager(bench: Bench) -> GenerationRun:
    bench.reset_routing()
    greedy_generate(bench.model, bench.prompt, bench.args.warmup_tokens)
    bench.reset_routing()
    return greedy_generate(bench.model, bench.prompt, bench.args.new_tokens)


def _graphed(bench: Bench) -> GenerationRun:
    runner = GraphedGenerator(
        bench.model, max_length=bench.prompt.shape[1] + bench.args.new_tokens, max_batch_size=bench.prompt.shape[0]
    )
    bench.reset_routing()
    runner.generate(bench.prompt, max_new_tokens=bench.args.warmup_tokens)  # warm-up steps, capture
    bench.reset_routing()
    return timed_generate(runner, bench.prompt, bench.args.new_tokens)  # the runner goes with this frame


def _ttft(bench: Bench) -> GenerationRun:
    """First token of the long prompt, after a short warm-up prompt; prefilled with grouped_mm
    (served blocks follow the switch too), then back to the decode implementation."""
    bench.model.set_experts_implementation("grouped_mm")
    try:
        bench.reset_routing()
        greedy_generate(bench.model, bench.ttft_prompt[:, :64], 1)
        bench.reset_routing()
        return greedy_generate(bench.model, bench.ttft_prompt, 1)
    finally:
        bench.model.set_experts_implementation(bench.args.experts_implementation)


def _cache_size(args, fraction: float) -> int:
    return max(args.top_k, round(fraction * args.experts))


def _mode(args) -> str:
    return "device" if args.device.type == "cuda" else "host"  # device mode on the CPU: interpreted, slow


def _cache_runs(bench: Bench, fraction: float, budget: str) -> list[dict]:
    """One cache size and budget: eager and graphed decode, then TTFT, on one enable (the
    served blocks follow ``set_experts_implementation``, so TTFT prefills with grouped_mm)."""
    args, rows = bench.args, []
    slots = _cache_size(args, fraction)
    label = {"budget": budget, "slots": slots}
    wanted = {variant for variant in args.variants if variant.startswith("cache-")}
    if "cache-eager" in wanted and args.eager_cache_mode != _mode(args):
        handle = enable_expert_cache(bench.model, cache_size=slots, budget=budget, mode=args.eager_cache_mode)
        before = handle.stats.total
        rows.append(_row(bench, "cache-eager", _eager(bench), handle=handle, before=before, **label))
        handle.disable()
        wanted.discard("cache-eager")
    if not wanted:
        return rows
    handle = enable_expert_cache(bench.model, cache_size=slots, budget=budget, mode=_mode(args))
    for variant, run in (("cache-eager", _eager), ("cache-graphed", _graphed), ("cache-ttft", _ttft)):
        if variant in wanted:
            before = handle.stats.total
            rows.append(_row(bench, variant, run(bench), handle=handle, before=before, **label))
    handle.disable()  # after the runner (and its graphs) went with _graphed's frame
    return rows


def _accelerate_runs(bench: Bench) -> list[dict]:
    """accelerate's offload at the GPU budget of the smallest cache (last: it keeps its hooks)."""
    from accelerate import dispatch_model, infer_auto_device_map

    args, model = bench.args, bench.model
    slots = _cache_size(args, min(args.fractions))
    non_expert = sum(p.nbytes for p in model.parameters()) - bench.expert_bytes
    budget = non_expert + bench.expert_bytes * slots // args.experts
    model.to("cpu")  # offloaded weights must live in host memory, not stay on the GPU
    torch.cuda.empty_cache()
    device_map = infer_auto_device_map(
        model,
        max_memory={args.device.index or 0: budget, "cpu": 2**40},
        no_split_module_classes=model._no_split_modules,
    )
    dispatch_model(model, device_map=device_map)
    on_gpu = sum(1 for place in device_map.values() if place not in ("cpu", "disk"))
    print(f"accelerate: GPU budget {budget / 1e9:.1f} GB, {on_gpu} of {len(device_map)} device-map entries on the GPU")
    label = {"budget": f"{budget / 1e9:.1f} GB", "slots": ""}
    rows = []
    if "accelerate" in args.variants:
        bench.reset_routing()
        greedy_generate(model, bench.prompt, 1)  # warm-up
        bench.reset_routing()
        rows.append(
            _row(bench, "accelerate", greedy_generate(model, bench.prompt, args.accelerate_new_tokens), **label)
        )
    if "accelerate-ttft" in args.variants:
        rows.append(_row(bench, "accelerate-ttft", _ttft(bench), **label))
    return rows


def main() -> None:
    args = _arguments()
    env = environment()
    print(
        f"{env['gpu']}; torch {env['torch']}, triton {env['triton']}, transformers {transformers.__version__}, "
        f"commit {env['commit']}"
    )
    bench = _build(args)
    print(
        f"{args.model} shapes ({args.family}): {args.layers} MoE layers x {args.experts} experts of "
        f"{args.hidden} x {args.intermediate}, top-{args.top_k}, {str(args.dtype).removeprefix('torch.')}; "
        f"experts {bench.expert_bytes / 1e9:.2f} GB; batch {args.batch}, prompt {args.prompt_tokens}, "
        f"{args.new_tokens} new tokens; routing {'the Qwen3-30B-A3B trace' if args.trace else 'the random router'}"
    )
    rows = []
    if "resident-eager" in args.variants:
        rows.append(_row(bench, "resident-eager", _eager(bench)))
    if "resident-graphed" in args.variants:
        rows.append(_row(bench, "resident-graphed", _graphed(bench)))
    if "resident-ttft" in args.variants:
        rows.append(_row(bench, "resident-ttft", _ttft(bench)))
    for fraction in args.fractions:
        for budget in args.budgets:
            rows.extend(_cache_runs(bench, fraction, budget))
    if any(v.startswith("accelerate") for v in args.variants):  # last: dispatch_model leaves its hooks
        try:
            rows.extend(_accelerate_runs(bench))
        except ImportError as error:
            print(f"accelerate variants skipped: {error}")
    _report(args, rows)


def _report(args, rows: list[dict]) -> None:
    print_table(rows, COLUMNS, title="tok/s: new tokens / wall time of the timed call (prefill included)")
    mismatches = [f"{r['variant']} {r['budget']} {r['slots']}".strip() for r in rows if r["same_tokens"] is False]
    unchecked = sum(r["same_tokens"] == "n/a" for r in rows)
    print(f"tokens differ from the resident run's: {', '.join(mismatches)}" if mismatches else "same tokens: all runs")
    if unchecked:
        print(f"({unchecked} runs unchecked: no resident run of their phase in this process)")
    if args.dry_run:
        print("dry run: graphed variants took the eager path (no CUDA), caches host mode; no CSV row written")
        return
    setup = {
        "transformers": transformers.__version__, "model": args.model, "family": args.family,
        "layers": args.layers, "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
        "intermediate": args.intermediate, "dtype": str(args.dtype).removeprefix("torch."),
        "implementation": args.experts_implementation, "batch": args.batch,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "ttft_tokens": args.ttft_tokens, "routing": "qwen3-trace" if args.trace else "router",
    }  # fmt: skip
    path = append_csv("bench_generate", [{**setup, **row} for row in rows])
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
