"""Expert parallelism under a real trace: per-rank step time, hit rate and bytes, pacing off/on.

A stack of MoE layers at Qwen3-30B-A3B shapes (H=2048, I=768, E=128, top-8, bf16) is split
over the ranks (`ExpertParallelMoE`, contiguous placement by default); each rank decodes
``--tokens-per-rank`` sequences whose routing is replayed from the real Qwen3 trace (layer
columns spread over its 48 layers). For every cache size (a fraction of each rank's local
experts, per layer) and pacing off/on, it times ``--steps`` decode steps after ``--warmup``
and reports, per rank and run (``--repeats`` runs alternate off and on): mean, median and
p90 step time, hit rate, misses per step, MB copied, pacing holds. Rank 0 prints a table
and appends one CSV row per rank and run (GPU name, versions, NCCL, commit) to
``benchmarks/results/bench_ep.csv``. Each layer's experts are pinned once and shared by
every configuration (a fresh slot cache each time).

Two GPUs (NCCL)::

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_ep.py
    python benchmarks/bench_ep.py --spawn 2

CPU smoke run (gloo, tiny shapes)::

    python benchmarks/bench_ep.py --spawn 2 --device cpu --hidden 64 --inter 32 \
        --dtype float32 --layers 2 --steps 4 --warmup 1

NVLink multicast stays off: the variables below are set before any process group exists.
"""

from __future__ import annotations

import os

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(MULTICAST_OFF)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _common import append_csv, print_table, traces_dir  # noqa: E402
from ep_routing import QWEN3_TRACE, DecodeReplay, load_sequences, pick_columns  # noqa: E402

from expertcache.layout import layout_from_weights  # noqa: E402
from expertcache.parallel import ExpertParallelMoE, ExpertPartition, LocalExperts  # noqa: E402
from expertcache.stats import CacheStats  # noqa: E402
from expertcache.store import CPUBackingStore  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="JSONL window dir or .npz (default: the Qwen3 windows in benchmarks/_common.traces_dir())",
    )
    p.add_argument("--layers", type=int, default=8, help="MoE layers (trace columns) per step")
    p.add_argument("--tokens-per-rank", type=int, default=1, help="decode batch per rank")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--fractions", default="0.25,0.5", help="cache sizes, of local experts")
    p.add_argument("--pacing", default="off,on", help="pacing settings to run")
    p.add_argument("--repeats", type=int, default=2, help="runs of the pacing settings, alternated")
    p.add_argument("--chunk-mib", type=float, default=4.0, help="pacing chunk (MiB)")
    p.add_argument("--scheme", default="contiguous", choices=["contiguous", "round_robin"])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--spawn", type=int, default=0, help="start N ranks here (else torchrun)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.spawn:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(run_rank, args=(args.spawn, port, args), nprocs=args.spawn, join=True)
    else:  # torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)


def run_rank(rank: int, world_size: int, port: int | None, args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    init = f"tcp://127.0.0.1:{port}" if port else "env://"
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size)
    try:
        results = benchmark(rank, world_size, device, args)
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, results)
        if rank == 0:
            rows = [row for per_rank in zip(*gathered, strict=True) for row in per_rank]
            nccl = torch.cuda.nccl.version() if device.type == "cuda" else ()
            rows = [{**row, "nccl": ".".join(map(str, nccl))} for row in rows]
            print_table(rows, TABLE, title=title(rows[0]))
            print(f"appended {len(rows)} rows to {append_csv('bench_ep', rows)}")
    finally:
        dist.destroy_process_group()


def benchmark(rank: int, world_size: int, device: torch.device, args) -> list[dict]:
    sequences, num_experts = load_sequences(args.trace or traces_dir() / QWEN3_TRACE, 8)
    columns = pick_columns(sequences[0].shape[1], args.layers)
    replay = DecodeReplay(sequences, rank=rank, tokens_per_rank=args.tokens_per_rank)
    partition = ExpertPartition(num_experts, world_size, args.scheme)
    dtype = getattr(torch, args.dtype)
    local_count = len(partition.local_experts(rank))
    stores = [pinned_store(local_count, args, dtype, device, seed) for seed in range(len(columns))]
    rows = []
    settings = [p.strip() == "on" for p in args.pacing.split(",")]
    for fraction in [float(f) for f in args.fractions.split(",")]:
        for repeat, pacing in ((r, p) for r in range(args.repeats) for p in settings):
            slots = max(1, round(fraction * local_count))
            layers = [
                ExpertParallelMoE(
                    LocalExperts(store, partition, rank, cache_size=slots, device=device),
                    pacing=pacing,
                    pacing_chunk_bytes=int(args.chunk_mib * (1 << 20)),
                )
                for store in stores
            ]
            row = run_steps(layers, replay, columns, args, dtype, device)
            row.update(
                cache=f"{fraction:.0%} ({slots}/{local_count})",
                rank=rank,
                world_size=world_size,
                fraction=fraction,
                slots=slots,
                local_experts=local_count,
                pacing="on" if pacing else "off",
                repeat=repeat,
                expert_bytes=layers[0].local.provider.pool.layout.expert_bytes,
                layers=len(columns),
                tokens_per_rank=args.tokens_per_rank,
                scheme=args.scheme,
                chunk_mib=args.chunk_mib,
                dtype=args.dtype,
                hidden=args.hidden,
                inter=args.inter,
                num_experts=num_experts,
            )
            rows.append(row)
            del layers
            gc.collect()  # free this configuration's slot buffers before the next
    return rows


def pinned_store(count: int, args, dtype, device: torch.device, seed: int) -> CPUBackingStore:
    """Random ``w1`` ``[count, 2I, H]`` and ``w2`` ``[count, H, I]`` in a (pinned) store."""
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + seed)
    shapes = {"w1": (count, 2 * args.inter, args.hidden), "w2": (count, args.hidden, args.inter)}
    scale = {"w1": args.hidden**-0.5, "w2": args.inter**-0.5}
    weights = {
        name: (torch.randn(shape, generator=gen, device=device) * scale[name]).to(dtype).cpu()
        for name, shape in shapes.items()
    }
    _, layout = layout_from_weights(weights)
    return CPUBackingStore(layout, weights, pin=device.type == "cuda")


def run_steps(layers, replay: DecodeReplay, columns, args, dtype, device) -> dict:
    batch, top_k = args.tokens_per_rank, replay.sequences[0].shape[2]
    start_hidden = torch.randn(batch, args.hidden, device=device).to(dtype)
    router = torch.full((batch, top_k), 1 / top_k, device=device)  # the trace has no gates
    times, before = [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            before = (total_stats(layers), sum(layer.pacer.stats.holds for layer in layers))
        ids = [torch.from_numpy(replay.ids(step, c)).to(device) for c in columns]
        dist.barrier()
        synchronize(device)
        began = time.perf_counter()
        hidden = start_hidden
        for layer, layer_ids in zip(layers, ids, strict=True):
            hidden = hidden + layer(hidden, router, layer_ids)
        synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - began)
    assert before is not None
    stats = diff(total_stats(layers), before[0])
    milliseconds = np.asarray(times) * 1e3
    return {
        "step_ms_mean": float(milliseconds.mean()),
        "step_ms_median": float(np.median(milliseconds)),
        "step_ms_p90": float(np.percentile(milliseconds, 90)),
        "hit_rate": stats.hit_rate,
        "misses_per_step": stats.misses / args.steps,
        "mb_copied": stats.bytes_h2d / 1e6,
        "holds": sum(layer.pacer.stats.holds for layer in layers) - before[1],
        "steps": args.steps,
    }


TABLE = [
    "cache",
    "pacing",
    "repeat",
    "rank",
    "step_ms_mean",
    "step_ms_median",
    "step_ms_p90",
    "hit_rate",
    "misses_per_step",
    "mb_copied",
    "holds",
]


def title(row: dict) -> str:
    return (
        f"EP benchmark: {row['world_size']} ranks, {row['layers']} layers, "
        f"E={row['num_experts']} ({row['scheme']}), H={row['hidden']}, I={row['inter']}, "
        f"{row['dtype']}, {row['tokens_per_rank']} token(s)/rank/step, {row['steps']} timed "
        f"steps, expert {row['expert_bytes'] / 1e6:.2f} MB"
    )


def total_stats(layers) -> CacheStats:
    return sum((layer.stats for layer in layers), CacheStats())


def diff(after: CacheStats, before: CacheStats) -> CacheStats:
    names = [field.name for field in dataclasses.fields(CacheStats)]
    return CacheStats(**{name: getattr(after, name) - getattr(before, name) for name in names})


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
