"""Greedy decode speed of a transformers MoE model with the expert cache at several sizes.

A random model with Qwen3-30B-A3B's expert shapes (128 experts of hidden 2048 x
intermediate 768, top-8; 9.4 MB per expert in bf16) and fewer layers is built on the GPU.
It decodes greedily with every expert resident, then with the cache at 25%, 50% and 100% of
each layer's experts. Each run starts with a short warm-up generation (its misses and first
calls stay out of the timing), then times ``--new-tokens`` tokens at batch size 1.

Random weights route close to uniformly (the script prints how many distinct experts the
decode steps used against what uniform routing would use), so the hit rates here are a
worst case: real models route with strong skew.

Prints a table and appends one row per run, stamped with GPU name, versions and commit, to
``benchmarks/results/bench_generate.csv``.

    python benchmarks/bench_generate.py [--layers 16]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch
import transformers
from _common import append_csv, environment

from expertcache.integrations.transformers import enable_expert_cache
from expertcache.integrations.transformers.generation import greedy_generate
from expertcache.integrations.transformers.random_models import ModelSizes, random_model
from expertcache.stats import CacheStats
from expertcache.trace import RoutingRecorder


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--layers", type=int, default=16, help="MoE layers (Qwen3-30B-A3B: 48)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--budget", choices=("per-layer", "global"), default="global")
    parser.add_argument("--modes", nargs="+", choices=("host", "device"), default=["host", "device"])
    parser.add_argument(
        "--experts-implementation",
        default="batched_mm",
        help="transformers experts function for every run (generate() would otherwise swap "
        "grouped_mm for batched_mm while decoding, which the cache cannot see)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    return parser.parse_args()


def _difference(after: CacheStats, before: CacheStats) -> CacheStats:
    names = [field.name for field in dataclasses.fields(CacheStats)]
    return CacheStats(**{name: getattr(after, name) - getattr(before, name) for name in names})


def _routing_spread(recorder: RoutingRecorder, decode_from: int) -> str:
    trace = recorder.trace()
    decode = trace.expert_ids[decode_from:]
    used = np.mean([np.unique(decode[:, c]).size for c in range(trace.num_layers)])
    uniform = trace.num_experts * (1 - (1 - trace.top_k / trace.num_experts) ** decode.shape[0])
    return (
        f"decode routing used {used:.1f} of {trace.num_experts} experts per layer over "
        f"{decode.shape[0]} steps; uniform routing would use {uniform:.1f}"
    )


def main() -> None:
    args = _arguments()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sizes = ModelSizes(
        num_moe_layers=args.layers, num_experts=args.experts, top_k=args.top_k,
        hidden=args.hidden, intermediate=args.intermediate, vocab=args.vocab, heads=32,
        head_dim=128,
    )  # fmt: skip
    model = random_model(args.family, sizes, dtype=dtype, device=device)
    model.set_experts_implementation(args.experts_implementation)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (1, args.prompt_tokens), generator=generator).to(device)
    env = environment()
    print(
        f"{env['gpu']}; torch {env['torch']}, triton {env['triton']}, transformers "
        f"{transformers.__version__}, commit {env['commit']}"
    )
    print(
        f"{args.family}: {args.layers} MoE layers x {args.experts} experts, top-{args.top_k}, "
        f"hidden {args.hidden}, expert intermediate {args.intermediate}, {args.dtype}, "
        f"experts implementation {args.experts_implementation}, budget {args.budget}"
    )

    greedy_generate(model, prompt, args.warmup_tokens)
    baseline = greedy_generate(model, prompt, args.new_tokens, progress="no cache")
    expert_bytes = sum(p.nbytes for n, p in model.named_parameters() if ".experts." in n)
    rows = [_row("no cache", None, baseline, baseline, None, expert_bytes, expert_bytes)]
    runs = [(mode, fraction) for mode in args.modes for fraction in args.fractions]
    for mode, fraction in runs:
        cache_size = max(args.top_k, round(fraction * args.experts))
        recorder = RoutingRecorder() if (mode, fraction) == runs[-1] else None
        handle = enable_expert_cache(model, cache_size=cache_size, budget=args.budget, recorder=recorder, mode=mode)
        greedy_generate(model, prompt, args.warmup_tokens)
        before = handle.stats.total
        if recorder is not None:
            recorder.begin_request()
            decode_from = recorder.trace().num_tokens + args.prompt_tokens
        run = greedy_generate(model, prompt, args.new_tokens, progress=f"cache {fraction:.0%}")
        stats = _difference(handle.stats.total, before)
        rows.append(_row(f"{mode} {fraction:.0%}", cache_size, run, baseline, stats, handle.slot_bytes, expert_bytes))
        handle.disable()
    _print(rows)
    print(_routing_spread(recorder, decode_from))
    _append_csv(args, rows)


def _row(label, cache_size, run, baseline, stats, device_bytes, expert_bytes) -> dict:
    return {
        "cache": label,
        "cache_size": cache_size or "",
        "tokens_per_s": round(run.tokens_per_second, 2),
        "identical_tokens": bool(torch.equal(run.tokens, baseline.tokens)),
        "hit_rate": "" if stats is None else round(stats.hit_rate, 4),
        "mb_copied": 0 if stats is None else round(stats.bytes_h2d / 1e6, 1),
        "expert_mb_on_device": round(device_bytes / 1e6, 1),
        "expert_mb_total": round(expert_bytes / 1e6, 1),
        "peak_mb": "" if run.peak_bytes is None else round(run.peak_bytes / 1e6, 1),
    }


def _print(rows: list[dict]) -> None:
    header = (
        f"{'cache':>12} {'slots/layer':>11} {'tok/s':>8} {'tokens ==':>9} {'hit rate':>8} "
        f"{'MB copied':>10} {'expert MB on GPU':>16} {'peak MB':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        hit = "-" if r["hit_rate"] == "" else f"{r['hit_rate']:.1%}"
        print(
            f"{r['cache']:>12} {r['cache_size']!s:>11} {r['tokens_per_s']:>8.1f} "
            f"{'yes' if r['identical_tokens'] else 'NO':>9} {hit:>8} {r['mb_copied']:>10.1f} "
            f"{r['expert_mb_on_device']:>16.1f} {r['peak_mb']!s:>9}"
        )


def _append_csv(args, rows: list[dict]) -> None:
    setup = {
        "transformers": transformers.__version__, "family": args.family, "layers": args.layers,
        "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
        "intermediate": args.intermediate, "dtype": args.dtype,
        "implementation": args.experts_implementation, "budget": args.budget,
        "new_tokens": args.new_tokens,
    }  # fmt: skip
    path = append_csv("bench_generate", [{**setup, **row} for row in rows])
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
