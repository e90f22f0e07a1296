"""Decode steps with the cache inside, side by side, routing replayed from a real trace.

Variants (one process, same kernels, same routing):
  (a) all experts resident (FullGPUProvider), eager and CUDA graph
  (b) host-driven CachedWeightProvider, eager (it cannot be captured)
  (c) device-driven CachedWeightProvider, eager
  (d) device-driven CachedWeightProvider, whole step in one CUDA graph: hits computed while
      the misses are copied on a side stream (``passes(ids, overlap=True)``), launches chained
  (d') the same without the overlap; (d'') also without chained launches (programmatic
      dependent launch), the previous release's step
  (e) flashlib 0.4.0 lru_ensure driving the same slots and copy kernel, CUDA graph
  (f) whole-layer streaming (every expert of a layer copied each step), eager

Physical bound of a cached step: (a)'s graphed step time + miss bytes / measured pinned
copy bandwidth (one 256 MiB copy-engine transfer from a fresh pinned buffer). Beside it
``store_bound``: the same with the copy engine's best rate on bursts read from the store's
own pages inside a graph (the copy-burst sweep), which does not depend on where a fresh
buffer's pages land (55.0 and 51.4 GB/s in two runs of one session). Each variant runs
the trace once to warm the cache, then once timed.
Copy bursts and admission are timed inside CUDA graphs, as the decode step runs them.

``--compression exponent`` runs instead the comparison of raw and exponent-coded stores
(`expertcache.compression`) side by side: (a) graphed, then (d) device graph with each
store at every fraction. Bound of a coded step: (a) + *coded* miss bytes / pinned
bandwidth (what crosses PCIe); ``eff_raw_gbps`` = raw miss bytes delivered into slots per
second of the step's time above (a), against the pinned bandwidth (``eff_vs_pinned`` > 1:
the code delivers more than PCIe carries). The coded stores are encoded on the GPU.
``--dry-run``: that comparison on a CPU, tiny fp16 shapes, interpreted kernels, eager
device mode, results to a temporary folder: a check, not a measurement.

    python benchmarks/bench_decode.py [--layers 12] [--fractions 0.25 0.5 1.0]
    python benchmarks/bench_decode.py --compression exponent [--skip-raw]
    python benchmarks/bench_decode.py --compression exponent --dry-run
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import append_csv, cuda_time_ms, pinned_copy_gbps, print_table, traces_dir  # noqa: E402
from baselines import FlashlibLRUProvider, WholeLayerStreamingProvider  # noqa: E402

from expertcache import CachedWeightProvider, FullGPUProvider, device_prepare  # noqa: E402
from expertcache.decode_stack import DecodeStack, GraphedDecodeStep  # noqa: E402
from expertcache.kernels import _launch  # noqa: E402
from expertcache.kernels.copy_experts import (  # noqa: E402
    DEFAULT_BLOCK,
    DEFAULT_PROGRAMS,
    CopyPlan,
    build_segments,
    copy_experts,
)
from expertcache.layout import layout_from_weights  # noqa: E402
from expertcache.mover import copy_pairs  # noqa: E402
from expertcache.stats import CacheStats  # noqa: E402
from expertcache.store import CPUBackingStore  # noqa: E402

QWEN3_TRACE = "qwen3-30b-a3b-instruct-2507__local-moe-inference-stack"
SHAPES = {
    # bf16, routing: the Qwen3-30B-A3B trace, layer l = trace layer l
    "qwen3-30b-a3b": dict(name="Qwen3-30B-A3B", hidden=2048, inter=768, experts=128, top_k=8, layers=12),
    # fp8 e4m3 with 128x128 block scales (44 MB per expert); no DeepSeek trace exists here, so
    # layer l's top-8 = the first 4 ids of trace layers 2l (experts 0-127) and 2l+1 (128-255)
    "deepseek-v3": dict(name="DeepSeek-V3 fp8", hidden=7168, inter=2048, experts=256, top_k=8, layers=4),
}
#: ``--dry-run``: Qwen3's routing (128 experts) on tiny fp16 experts (the interpreter does fp16 math, not bf16)
TINY = dict(name="tiny (dry run)", hidden=64, inter=32, experts=128, top_k=8, layers=2, dtype=torch.float16)


def qwen3_routing(folder: Path, layers: int) -> np.ndarray:
    """``[N, layers, 8]`` expert ids of the Qwen3-30B-A3B trace windows, in file order."""
    tokens = []
    for path in sorted(folder.glob("window_*.jsonl")):
        per_token: dict[tuple, list] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            per_token.setdefault((record["prompt_id"], record["token_pos"]), []).append(record["experts"])
        tokens.extend(ids[:layers] for ids in per_token.values())
    return np.asarray(tokens, dtype=np.int64)


def shape_routing(key: str, layers: int) -> np.ndarray:
    """``[N, layers, 8]`` routing for a shape, replayed from the real Qwen3 trace."""
    if key == "qwen3-30b-a3b":
        return qwen3_routing(traces_dir() / QWEN3_TRACE, layers)
    qwen = qwen3_routing(traces_dir() / QWEN3_TRACE, 2 * layers)
    return np.concatenate([qwen[:, 0::2, :4], 128 + qwen[:, 1::2, :4]], axis=2)


def shape_weights(key: str, shape: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One layer's random expert weights on ``gen``'s device (the GPU), in the shape's format."""
    E, H, inter = shape["experts"], shape["hidden"], shape["inter"]
    if key == "qwen3-30b-a3b":
        dtype, device = shape.get("dtype", torch.bfloat16), gen.device
        return {
            "w1": torch.randn(E, 2 * inter, H, device=device, generator=gen, dtype=dtype) * H**-0.5,
            "w2": torch.randn(E, H, inter, device=device, generator=gen, dtype=dtype) * inter**-0.5,
        }
    weights = {"w1": (E, 2 * inter, H), "w2": (E, H, inter)}
    out = {}
    for name, size in weights.items():
        tensor = torch.empty(size, dtype=torch.float8_e4m3fn, device="cuda")
        for start in range(0, E, 16):  # bf16 staging in chunks, not all at once
            chunk = tensor[start : start + 16]
            chunk.copy_(torch.randn(chunk.shape, device="cuda", generator=gen, dtype=torch.bfloat16))
        out[name] = tensor
        blocks = (E, -(-size[1] // 128), -(-size[2] // 128))
        out[f"{name}_scale"] = (torch.rand(blocks, device="cuda", generator=gen) + 0.5) * size[2] ** -0.5
    return out


def total_stats(providers) -> CacheStats:
    return sum((p.stats for p in providers), CacheStats())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_pass(step: Callable, hidden: torch.Tensor, routing: torch.Tensor) -> float:
    """Milliseconds per step over the whole sequence (synchronised at both ends)."""
    sync(hidden.device)
    start = time.perf_counter()
    for index in range(routing.shape[0]):
        step(hidden[index], routing[index])
    sync(hidden.device)
    return (time.perf_counter() - start) * 1e3 / routing.shape[0]


def measure(name, providers, shape, hidden, routing, *, graph: bool, steps: int | None = None, overlap=True) -> dict:
    dtype = shape.get("dtype", torch.bfloat16)
    stack = DecodeStack(providers, shape["hidden"], shape["experts"], dtype=dtype, device=hidden.device,
                        overlap=overlap)  # fmt: skip
    hidden, routing = hidden[:steps], routing[:steps]
    step = GraphedDecodeStep(stack, hidden[0], routing[:1]) if graph else stack.step
    run_pass(step, hidden, routing)  # warm pass
    before = total_stats(providers)
    ms = run_pass(step, hidden, routing)
    delta = total_stats(providers)
    lookups = (delta.hits - before.hits) + (delta.misses - before.misses)
    tokens = routing.shape[0] * routing.shape[2]
    return {
        "variant": name,
        "ms_per_step": ms,
        "tok_per_s": 1e3 * routing.shape[2] / ms,
        "hit_rate": (delta.hits - before.hits) / lookups if lookups else 1.0,
        "gb_per_token": (delta.bytes_h2d - before.bytes_h2d) / tokens / 1e9,
        "compressed_gb_per_token": (delta.compressed_bytes_h2d - before.compressed_bytes_h2d) / tokens / 1e9,
    }


COPY_GRIDS = ((16, 4096), (64, 4096), (132, 2048), (132, 4096), (264, 2048), (528, 1024), (64, 16384))
BURSTS_PER_GRAPH = 10


def graph_ms(enqueue: Callable[[], object], repeats: int = 20) -> float:
    """Milliseconds of one replay of a CUDA graph holding ``enqueue()``'s launches (no host
    launch gaps, as in a captured decode step)."""
    enqueue()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        enqueue()
    return cuda_time_ms(graph.replay, repeats=repeats)


def bench_copy_kernel(store: CPUBackingStore, copy_gbps: float) -> list[dict]:
    """Copy bursts of 1, 2, 8, 32 experts inside a CUDA graph (``BURSTS_PER_GRAPH`` bursts
    of other experts and slots back to back, as the layers of a step): the copy kernel at
    several grid sizes against the copy engine's captured memcpys of the same bytes."""
    layout, cuda = store.layout, torch.device("cuda")
    if store.formats:
        raise ValueError("the copy-burst sweep copies raw bytes; decoding bursts: benchmarks/bench_compression.py")
    slots = layout.allocate(32, cuda, 0xFF)
    # the store's own offsets: a store's regions are its to place (coded ones are smaller)
    offsets, sizes = store.region_offsets, tuple(spec.nbytes for spec in layout.specs)
    segments = {block: build_segments(offsets, sizes, layout.copy_unit, block) for _, block in COPY_GRIDS}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for count in (1, 2, 8, 32):
        plans = [
            CopyPlan(
                torch.tensor([count], dtype=torch.int32, device=cuda),
                torch.randperm(store.num_experts, generator=gen)[:count].int().cuda(),
                torch.randperm(32, generator=gen)[:count].int().cuda(),
                1,
            )  # fmt: skip
            for _ in range(BURSTS_PER_GRAPH)
        ]

        def kernel_copies(programs, block, plans=plans):
            for plan in plans:
                copy_experts(store.buffer, list(slots.values()), plan, segments[block], unit=layout.copy_unit,
                             num_experts=store.num_experts, num_programs=programs)  # fmt: skip

        pairs = [
            (slots[name][s], store.tensors[name][e])
            for plan in plans
            for e, s in zip(plan.experts.tolist(), plan.slots.tolist(), strict=True)
            for name in slots
        ]
        nbytes = BURSTS_PER_GRAPH * count * layout.expert_bytes
        row = {"experts": count, "mb": count * layout.expert_bytes / 1e6,
               "copy_engine_gbps": nbytes / graph_ms(lambda pairs=pairs: copy_pairs(pairs)) / 1e6}  # fmt: skip
        for programs, block in COPY_GRIDS:
            ms = graph_ms(lambda programs=programs, block=block: kernel_copies(programs, block))
            row[f"kernel_{programs}x{block}_gbps"] = nbytes / ms / 1e6
        row["default_vs_pinned"] = row[f"kernel_{DEFAULT_PROGRAMS}x{DEFAULT_BLOCK}_gbps"] / copy_gbps
        row["best_kernel_vs_pinned"] = max(v for k, v in row.items() if k.startswith("kernel_")) / copy_gbps
        rows.append(row)
    return rows


def make_cached(kind: str, store: CPUBackingStore, slots: int, top_k: int):
    kind = kind.removesuffix(", unchained")
    if kind == "flashlib":
        return FlashlibLRUProvider(store, slots, top_k)
    return CachedWeightProvider(store, cache_size=slots, mode=kind)


def bench_admission(store: CPUBackingStore, top_k: int, skip_flashlib: bool) -> list[dict]:
    """Per-call cost of admission + copy launch at 100% hits, 100 calls in one CUDA graph.

    Device mode at its default, with its launches unchained (no programmatic dependent
    launch) and at other admission warp counts (the launcher's choice is made from this
    table), against flashlib's ``lru_ensure`` driving the same copy kernel.
    """
    rows = []
    ids = torch.arange(top_k, device="cuda").reshape(1, top_k)
    kinds = [("device", None), ("device, unchained", None), ("device", 1), ("device", 2), ("device", 8)] + (
        [] if skip_flashlib else [("flashlib", None)]
    )
    real_admit = device_prepare.admit
    for kind, warps in kinds:
        device_prepare.admit = real_admit if warps is None else functools.partial(real_admit, num_warps=warps)
        _launch.PROGRAMMATIC_LAUNCH = not kind.endswith("unchained")
        try:
            provider = make_cached(kind, store, 4 * top_k, top_k)
            provider.prepare(ids)  # compile and make the experts resident
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(100):
                    provider.prepare(ids)
            us = cuda_time_ms(graph.replay, repeats=20) * 10  # ms per 100 calls -> us per call
        finally:
            device_prepare.admit = real_admit
            _launch.PROGRAMMATIC_LAUNCH = True
        label = kind if warps is None else f"{kind}, {warps} warps"
        rows.append({"admission": label, "us_per_call_in_graph": us, "hit_rate": provider.stats.hit_rate})
        del provider, graph
    return rows


def build_stores(full: list[dict], layout, compression: str | None, pin: bool) -> tuple[list[CPUBackingStore], float]:
    """One store per layer (coded ones encoded where the weights are: the GPU), and seconds."""
    from tqdm.auto import tqdm

    device = full[0]["w1"].device
    sync(device)
    start = time.perf_counter()
    stores = [
        CPUBackingStore(layout, weights, pin=pin, compression=compression, progress=False)
        for weights in tqdm(full, desc=f"{compression or 'raw'} stores", unit="layer", leave=False, disable=None)
    ]
    sync(device)
    return stores, time.perf_counter() - start


def same_slots(first, second) -> bool:
    """Every layer's pool holds the same bytes in both provider lists."""
    return all(
        torch.equal(a.pool.tensors[name].view(torch.uint8), b.pool.tensors[name].view(torch.uint8))
        for a, b in zip(first, second, strict=True)
        for name in a.pool.tensors
    )


def compare_compression(args: argparse.Namespace) -> None:
    """(a) graphed, then (d) device graph over raw and exponent-coded stores, side by side."""
    device = torch.device("cpu") if args.dry_run else torch.device("cuda")
    shape = TINY if args.dry_run else SHAPES["qwen3-30b-a3b"]
    E, H, L, dtype = (
        shape["experts"],
        shape["hidden"],
        args.layers or shape["layers"],
        shape.get("dtype", torch.bfloat16),
    )
    routing = torch.from_numpy(shape_routing("qwen3-30b-a3b", L))[: args.steps].to(device)[:, :, None, :]
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(routing.shape[0], 1, H, device=device, generator=gen, dtype=dtype)
    full = [shape_weights("qwen3-30b-a3b", shape, gen) for _ in range(L)]
    _, layout = layout_from_weights(full[0])
    raw, raw_seconds = build_stores(full, layout, None, pin=device.type == "cuda")
    coded, coded_seconds = build_stores(full, layout, "exponent", pin=device.type == "cuda")
    raw_gb, coded_gb = sum(s.nbytes for s in raw) / 1e9, sum(s.nbytes for s in coded) / 1e9
    ratio = coded[0].stored_expert_bytes / layout.expert_bytes
    print(f"{shape['name']}: {L} layers x {E} experts, {routing.shape[0]} trace tokens; raw {raw_gb:.2f} GB "
          f"pinned in {raw_seconds:.1f} s; coded {coded_gb:.2f} GB (record ratio {ratio:.4f}) encoded on {device} "
          f"and pinned in {coded_seconds:.1f} s ({raw_gb / coded_seconds:.2f} GB/s of raw bytes)")  # fmt: skip
    copy_gbps = pinned_copy_gbps(256 * 2**20) if device.type == "cuda" else float("nan")
    graph = device.type == "cuda"  # graphs need CUDA; the dry run is eager
    resident = [FullGPUProvider(w) for w in full]
    rows = [{"cache": "all", "store": "-", **measure("(a) all resident" + " graph" * graph, resident, shape,
                                                     hidden, routing, graph=graph)}]  # fmt: skip
    base_ms = rows[0]["ms_per_step"]
    name = "(d) device graph" if graph else "(c) device eager"
    for fraction in args.fractions:
        slots = round(fraction * E)
        served = {}
        for label, stores in (("raw", raw), ("exponent", coded)):
            served[label] = [
                CachedWeightProvider(store, cache_size=slots, mode="device", device=device) for store in stores
            ]
            rows.append({"cache": f"{fraction:.0%}", "store": label,
                         **measure(name, served[label], shape, hidden, routing, graph=graph)})  # fmt: skip
        rows[-1]["slots_equal_raw"] = same_slots(served["raw"], served["exponent"])
        rows[-1]["speedup_vs_raw"] = rows[-2]["ms_per_step"] / rows[-1]["ms_per_step"]
        del served
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        row["bound_ms"] = base_ms + row["compressed_gb_per_token"] * 1e9 / (copy_gbps * 1e6)
        row["ratio_to_bound"] = row["ms_per_step"] / row["bound_ms"]
        extra_ms = row["ms_per_step"] - base_ms
        if row["gb_per_token"] > 0 and extra_ms > 0:
            row["eff_raw_gbps"] = row["gb_per_token"] * 1e9 / (extra_ms * 1e6)  # bs=1: one token a step
            row["eff_vs_pinned"] = row["eff_raw_gbps"] / copy_gbps
    columns = ["cache", "store", "variant", "ms_per_step", "tok_per_s", "hit_rate", "gb_per_token",
               "compressed_gb_per_token", "bound_ms", "ratio_to_bound", "eff_raw_gbps", "eff_vs_pinned",
               "speedup_vs_raw", "slots_equal_raw"]  # fmt: skip
    print_table(rows, columns, title=f"{shape['name']} decode, bs=1, {L} layers, raw vs exponent-coded stores; "
                                     f"bound = (a) {base_ms:.3f} ms + coded miss bytes / {copy_gbps:.1f} GB/s "
                                     f"(raw bytes: {copy_gbps / ratio:.1f} GB/s)")  # fmt: skip
    stamp = {"shape": shape["name"], "layers": L, "pinned_gbps": copy_gbps, "record_ratio": ratio,
             "encode_s": coded_seconds}  # fmt: skip
    print(f"CSV: {append_csv('bench_decode_compression', [{**stamp, **r} for r in rows])}")
    if any(r.get("slots_equal_raw") is False for r in rows):
        raise SystemExit("the coded stores' slots differ from the raw stores' slots")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's (12 or 4)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--streaming-steps", type=int, default=8)
    parser.add_argument("--skip-flashlib", action="store_true")
    parser.add_argument("--compression", choices=("none", "exponent"), default="none",
                        help="exponent: raw vs exponent-coded stores side by side (Qwen3 shapes) instead")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="trace tokens to replay (default all; 3 dry)")
    parser.add_argument("--dry-run", action="store_true", help="with --compression: CPU, tiny, interpreted")
    args = parser.parse_args()
    if args.dry_run:
        if args.compression == "none":
            parser.error("--dry-run runs the --compression exponent comparison")
        _common.RESULTS = Path(tempfile.mkdtemp(prefix="bench_decode_dry_"))
        args.steps = args.steps or 3
        if args.fractions == parser.get_default("fractions"):
            args.fractions = [8 / 128, 0.25]  # 8 slots = top-k: misses in the timed pass too
    if args.compression == "exponent":
        return compare_compression(args)
    shape = SHAPES[args.shape]
    E, H, L = shape["experts"], shape["hidden"], args.layers or shape["layers"]
    routing = torch.from_numpy(shape_routing(args.shape, L)).cuda()[:, :, None, :]  # [N, L, 1, K]
    steps = routing.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(steps, 1, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    start = time.perf_counter()
    full = [shape_weights(args.shape, shape, gen) for _ in range(L)]
    _, layout = layout_from_weights(full[0])
    stores = [CPUBackingStore(layout, w, pin=True) for w in full]
    print(f"{shape['name']}: {L} layers x {E} experts, {layout.expert_bytes / 1e6:.2f} MB per expert, "
          f"{steps} trace tokens; {sum(s.nbytes for s in stores) / 1e9:.1f} GB built and pinned "
          f"in {time.perf_counter() - start:.1f} s")  # fmt: skip
    copy_gbps = pinned_copy_gbps(256 * 2**20)
    expert_gbps = pinned_copy_gbps(layout.expert_bytes)
    print(f"pinned copy-engine bandwidth: {copy_gbps:.1f} GB/s (256 MiB), {expert_gbps:.1f} GB/s (one expert's bytes)")

    admission_rows = bench_admission(stores[0], shape["top_k"], args.skip_flashlib)
    print_table(admission_rows, list(admission_rows[0]), title="admission per call at 100% hits, in a CUDA graph")
    copy_rows = bench_copy_kernel(stores[0], copy_gbps)
    print_table(copy_rows, list(copy_rows[0]), title="copy bursts: GB/s of the copy kernel by grid size vs copy engine")

    rows = []
    resident = [FullGPUProvider(w) for w in full]
    for graph in (False, True):
        rows.append({"cache": "all", **measure(f"(a) all resident{' graph' if graph else ''}", resident, shape,
                                               hidden, routing, graph=graph)})  # fmt: skip
    base_ms = rows[-1]["ms_per_step"]
    staging = torch.empty(stores[0].nbytes, dtype=torch.uint8, device="cuda")
    streaming = [WholeLayerStreamingProvider(s, staging) for s in stores]
    rows.append({"cache": "stream", **measure("(f) whole-layer streaming", streaming, shape, hidden, routing,
                                              graph=False, steps=args.streaming_steps)})  # fmt: skip
    del staging, streaming

    for fraction in args.fractions:
        slots = round(fraction * E)
        variants = [
            ("(b) host-driven", "host", False),
            ("(c) device eager", "device", False),
            ("(d) device graph", "device", True),
            ("(d') device graph, no overlap", "device", True),
            ("(d'') device graph, no overlap, unchained launches", "device", True),
        ]
        if not args.skip_flashlib:
            variants.append(("(e) flashlib lru_ensure graph", "flashlib", True))
        for name, kind, graph in variants:
            providers = [make_cached(kind, store, slots, shape["top_k"]) for store in stores]
            _launch.PROGRAMMATIC_LAUNCH = "unchained" not in name
            try:
                row = measure(name, providers, shape, hidden, routing, graph=graph, overlap="no overlap" not in name)
            finally:
                _launch.PROGRAMMATIC_LAUNCH = True
            rows.append({"cache": f"{fraction:.0%}", **row})
            del providers
            torch.cuda.empty_cache()

    host_ms = {r["cache"]: r["ms_per_step"] for r in rows if r["variant"].startswith("(b)")}
    store_gbps = max(r["copy_engine_gbps"] for r in copy_rows)
    for row in rows:
        row["bound_ms"] = base_ms + row["gb_per_token"] * 1e9 / (copy_gbps * 1e6)
        row["ratio_to_bound"] = row["ms_per_step"] / row["bound_ms"]
        row["store_bound_ms"] = base_ms + row["gb_per_token"] * 1e9 / (store_gbps * 1e6)
        row["ratio_to_store_bound"] = row["ms_per_step"] / row["store_bound_ms"]
        if row["cache"] in host_ms:
            row["speedup_vs_b"] = host_ms[row["cache"]] / row["ms_per_step"]
    columns = ["cache", "variant", "ms_per_step", "tok_per_s", "hit_rate", "gb_per_token", "bound_ms",
               "ratio_to_bound", "ratio_to_store_bound", "speedup_vs_b"]  # fmt: skip
    print_table(rows, columns, title=f"{shape['name']} decode, bs=1, {L} layers; bound = (a) graph "
                                     f"{base_ms:.3f} ms + miss bytes / {copy_gbps:.1f} GB/s (store bound: "
                                     f"/ {store_gbps:.1f} GB/s, the engine's best on the store's bursts)")  # fmt: skip
    append_csv("bench_decode", [{"shape": shape["name"], "layers": L, "pinned_gbps": copy_gbps,
                                 "store_gbps": store_gbps, **r} for r in rows])  # fmt: skip
    append_csv("bench_copy", [{"shape": shape["name"], "pinned_gbps": copy_gbps, **r} for r in copy_rows])
    append_csv("bench_admission", [{"shape": shape["name"], **r} for r in admission_rows])


if __name__ == "__main__":
    main()
