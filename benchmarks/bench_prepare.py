"""prepare() cost of the host-driven (and device-driven) cache, Qwen3-30B-A3B expert shapes.

One process, side by side: prepare() per call at 100% hit and with 1, 2 and 8 misses per
call, for host mode moving misses with the copy engine and with the copy kernel, and for
device mode; the miss path's GB/s beside the measured pinned copy bandwidth (the physical
bound of a miss: expert bytes / pinned bandwidth); where host mode's time goes at 100%
hits (each step timed on the host); the remap kernel against torch indexing, eager and
inside a CUDA graph. Shapes: H=2048, I=768, E=128, K=8, bf16 (9.44 MB per expert).

    python benchmarks/bench_prepare.py [--calls 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_csv, cuda_time_ms, pinned_copy_gbps, print_table  # noqa: E402

from expertcache import CachedWeightProvider, SlotPool, host_prepare  # noqa: E402
from expertcache.kernels import remap_topk_ids  # noqa: E402
from expertcache.layout import layout_from_weights  # noqa: E402
from expertcache.slot_table import SlotTable  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, SLOTS = 2048, 768, 128, 8, 64


def call_sequence(misses: int, calls: int, seed: int) -> list[list[int]]:
    """Calls of TOP_K experts with exactly ``misses`` non-resident ones each (LRU, SLOTS slots)."""
    rng = random.Random(seed)
    table = SlotTable(SLOTS)
    table.admit(range(SLOTS))  # warm: experts 0..63 resident
    sequence = []
    for _ in range(calls):
        resident = sorted(k for k in table.resident())
        absent = sorted(set(range(EXPERTS)) - set(resident))
        experts = rng.sample(resident, TOP_K - misses) + rng.sample(absent, misses)
        rng.shuffle(experts)
        table.admit(experts)
        sequence.append(experts)
    return sequence


def time_prepare(provider, sequence) -> list[float]:
    """Per-call wall milliseconds, each call synchronised so its copies are included."""
    times = []
    for experts in sequence:
        ids = torch.tensor([experts], device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        provider.prepare(ids)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


VARIANTS = (("host", "engine"), ("host", "kernel"), ("device", "kernel"))


def make_provider(weights, mode: str, mover: str) -> CachedWeightProvider:
    pool = SlotPool(layout_from_weights(weights)[1], SLOTS, device="cuda", mode=mode, mover=mover)
    return CachedWeightProvider(weights, pool=pool)


def bench_prepare(weights, calls: int, copy_gbps: float) -> list[dict]:
    rows = []
    for mode, mover in VARIANTS:
        for misses in (0, 1, 2, 8):
            provider = make_provider(weights, mode, mover)
            provider.prepare(torch.arange(SLOTS, device="cuda").reshape(-1, TOP_K))  # warm the same 0..63
            sequence = call_sequence(misses, calls + 10, seed=misses)
            times = time_prepare(provider, sequence)[10:]
            ms = statistics.median(times)
            moved = misses * provider.pool.layout.expert_bytes
            bound_ms = moved / copy_gbps / 1e6
            rows.append({
                "bench": "prepare", "mode": mode, "mover": mover, "misses_per_call": misses, "ms_per_call": ms,
                "p90_ms": sorted(times)[int(0.9 * len(times))], "miss_gbps": moved / ms / 1e6 if misses else 0.0,
                "pinned_gbps": copy_gbps, "bound_ms": bound_ms, "ratio_to_bound": ms / bound_ms if misses else 0.0,
            })  # fmt: skip
    return rows


#: Host mode's steps (module, function), in call order; each is timed on the host.
STEPS = (
    ("read (ids + table to host, sync)", host_prepare, "_read"),
    ("keys (range check, map, dedupe)", host_prepare, "local_keys"),
    ("plan (policy, no change)", host_prepare, "plan_call"),
    ("upload plan", host_prepare, "_upload"),
    ("move (copies)", host_prepare, "_move"),
    ("commit kernel launch", host_prepare, "_commit"),
    ("tell the policy", host_prepare, "tell_policy"),
)


def host_breakdown(weights, calls: int) -> list[dict]:
    """Where a host-mode call's time goes at 100% hits: each step's median host time."""
    provider = make_provider(weights, "host", "engine")
    provider.prepare(torch.arange(SLOTS, device="cuda").reshape(-1, TOP_K))
    spent: dict[str, list[float]] = {label: [] for label, _, _ in STEPS}
    originals = [(module, name, getattr(module, name)) for _, module, name in STEPS]
    for (label, module, name), (_, _, real) in zip(STEPS, originals, strict=True):

        def timed(*args, real=real, label=label, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent[label].append((time.perf_counter() - start) * 1e3)

        setattr(module, name, timed)
    try:
        totals = time_prepare(provider, call_sequence(0, calls + 10, seed=5))[10:]
    finally:
        for module, name, real in originals:
            setattr(module, name, real)
    rows = [
        {"bench": "host breakdown", "step": label, "median_ms": statistics.median(t[10:])} for label, t in spent.items()
    ]
    total = statistics.median(totals)
    rows.append({"bench": "host breakdown", "step": "everything else (guards, checks, result)",
                 "median_ms": total - sum(row["median_ms"] for row in rows)})  # fmt: skip
    rows.append({"bench": "host breakdown", "step": "total prepare()", "median_ms": total})
    return rows


def bench_remap(repeats: int) -> list[dict]:
    ids = torch.randint(0, EXPERTS, (1, TOP_K), device="cuda")
    mapping = torch.randperm(EXPERTS, device="cuda").int()
    out = torch.empty_like(ids)
    variants = {
        "triton remap_topk_ids": lambda: remap_topk_ids(ids, mapping, out=out),
        "torch mapping[ids]": lambda: mapping[ids],
    }
    rows = []
    for name, fn in variants.items():
        eager_ms = cuda_time_ms(lambda fn=fn: [fn() for _ in range(100)], repeats) / 100
        graph = torch.cuda.CUDAGraph()
        fn()
        with torch.cuda.graph(graph):
            for _ in range(100):
                fn()
        graph_ms = cuda_time_ms(graph.replay, repeats) / 100
        rows.append({"bench": "remap", "variant": name, "eager_us": eager_ms * 1e3, "graph_us": graph_ms * 1e3})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        "w1": torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16),
        "w2": torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen, dtype=torch.bfloat16),
    }
    expert = layout_from_weights(weights)[1].expert_bytes
    copy_gbps = pinned_copy_gbps(expert)
    big_gbps = pinned_copy_gbps(8 * expert)
    print(f"pinned copy-engine bandwidth: {copy_gbps:.1f} GB/s for one {expert / 1e6:.2f} MB expert, "
          f"{big_gbps:.1f} GB/s for 8 experts ({8 * expert / 1e6:.1f} MB)")  # fmt: skip
    prepare_rows = bench_prepare(weights, args.calls, copy_gbps)
    columns = ["mode", "mover", "misses_per_call", "ms_per_call", "p90_ms", "miss_gbps", "pinned_gbps", "bound_ms"]
    title = f"prepare(), Qwen3-30B-A3B experts (bound = miss bytes / {copy_gbps:.1f} GB/s pinned)"
    print_table(prepare_rows, [*columns, "ratio_to_bound"], title=title)
    breakdown = host_breakdown(weights, args.calls)
    print_table(breakdown, ["step", "median_ms"], title="host mode at 100% hits: where a call's time goes")
    remap_rows = bench_remap(repeats=50)
    print_table(remap_rows, ["variant", "eager_us", "graph_us"], title="remap of [1, 8] ids, per call")
    path = append_csv("bench_prepare", [*prepare_rows, *breakdown, *remap_rows])
    print(f"\nrows appended to {path}")


if __name__ == "__main__":
    main()
