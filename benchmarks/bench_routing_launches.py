"""Launch settings of the one-program routing kernels: device admission, pass assignment, pair sort.

These kernels run as one program (they walk a call in order: first appearances, LRU stamps,
ranks), so their time is latency, not bandwidth: how many ids one step reads (``block``)
and how many warps share it are the only knobs. Side by side in one process, each setting
against the current default (ratio = time / default's time; there is no physical bound
to compare with beyond the launch itself, a few microseconds):

    admission, prefill    `assign_passes` + every pass's `admit` of one layer's call of T
                          tokens from the real Qwen3-30B-A3B trace (K=8, 128 experts, 32 slots:
                          25%), cold tables each replay; (block, warps) of both kernels
    pair sort             `sort_pairs_by_expert` (the grouped apply's routing) of a decode
                          call of B tokens over S slots: one program (a call of one chunk)
                          or C (count, cumsum, place), and their warps

Each setting's results are checked against the default's (slot ids, tables, rows: exactly
equal) before it is timed. Times: CUDA-graph replays of 16 calls, median.

    python benchmarks/bench_routing_launches.py [--tokens 1024 4096] [--batch-sizes 8 16 32 128]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_csv, print_table, traces_dir  # noqa: E402
from bench_decode import QWEN3_TRACE, qwen3_routing  # noqa: E402
from bench_gemv_tiles import graphed_us  # noqa: E402

from expertcache.kernels import admission  # noqa: E402
from expertcache.kernels._launch import walk_launch  # noqa: E402
from expertcache.kernels.admission import admit  # noqa: E402
from expertcache.kernels.grouped_apply import default_tiles  # noqa: E402
from expertcache.kernels.grouped_routing import sort_launch, sort_pairs_by_expert  # noqa: E402
from expertcache.kernels.passes import assign_passes  # noqa: E402
from expertcache.kernels.slot_tables import SlotTables  # noqa: E402
from expertcache.passes import max_passes  # noqa: E402

EXPERTS, TOP_K, PREFILL_SLOTS, CALLS = 128, 8, 32, 16
BLOCKS, WARPS = (1024, 2048, 4096), (4, 8, 16)
SORT_WARPS, SORT_SLOTS = (2, 4, 8, 16), (32, 64, 768)
COLUMNS = [
    "kernel", "size", "ids", "slots", "passes", "block", "programs", "warps", "default", "us", "ratio_to_default",
]  # fmt: skip


def shown(row: dict) -> dict:
    """Print ``row`` as soon as it is measured (compiling every setting takes a while)."""
    print("  ".join(f"{key}={row[key]:.3g}" if isinstance(row[key], float) else f"{key}={row[key]}"
                    for key in COLUMNS if key in row), flush=True)  # fmt: skip
    return row


def trace_ids(tokens: int) -> np.ndarray:
    """``[T, K]`` ids of the Qwen3-30B-A3B trace's first layer, tokens 0 .. T-1 (wrapping)."""
    trace = qwen3_routing(traces_dir() / QWEN3_TRACE, 1)[:, 0]
    return trace[np.arange(tokens) % trace.shape[0]].astype(np.int32)


def compared(row: dict, settings: list[dict], outputs: Callable, calls: Callable) -> list[dict]:
    """``row`` at each of ``settings`` (the first is the default): ``outputs(setting)`` checked
    equal to the default's, then ``calls(setting)`` (thunks) timed in one CUDA graph."""
    rows, expected, default_us = [], None, None
    for setting in settings:
        result = outputs(setting)
        if expected is None:
            expected = result
        elif not all(torch.equal(a, b) for a, b in zip(result, expected, strict=True)):
            raise AssertionError(f"{row['kernel']} at {row['size']} with {setting} differs from the default's")
        us = graphed_us(calls(setting))
        default_us = default_us or us
        rows.append(shown({**row, **setting, "default": not rows, "us": us, "ratio_to_default": us / default_us}))
    return rows


def admission_rows(tokens: int, device: torch.device) -> list[dict]:
    """`assign_passes` and every pass's `admit` of one layer's prefill call, from cold tables
    (the reset, a device copy of the state, is part of each timed call)."""
    ids = torch.from_numpy(trace_ids(tokens)).to(device).contiguous()
    count = max_passes(ids.numel(), EXPERTS, PREFILL_SLOTS)
    where = dict(num_global=EXPERTS, key_offset=0)
    fresh = SlotTables.allocate(EXPERTS, PREFILL_SLOTS, 1, device)
    tables = SlotTables.allocate(EXPERTS, PREFILL_SLOTS, 1, device)
    outs, pass_of = [torch.empty_like(ids) for _ in range(count)], torch.empty_like(ids)

    def run(block: int, warps: int) -> None:
        tables.buffer.copy_(fresh.buffer)  # cold, each replay alike
        assign_passes(tables, ids, None, pass_of, block_ids=block, num_warps=warps, **where)
        for index, out in enumerate(outs):
            admit(tables, ids, None, out, layer=0, passes=pass_of, pass_index=index, block_ids=block,
                  num_warps=warps, **where)  # fmt: skip

    def outputs(setting: dict) -> list[torch.Tensor]:
        run(**setting)
        return [tables.buffer.clone(), pass_of.clone(), *[out.clone() for out in outs]]

    default = walk_launch(ids.numel())
    settings = [default, *[s for s in itertools.product(BLOCKS, WARPS) if s != default]]
    row = {"kernel": "admission", "size": f"T={tokens}", "ids": ids.numel(), "slots": PREFILL_SLOTS, "passes": count}
    return compared(row, [{"block": b, "warps": w} for b, w in settings], outputs,
                    lambda setting: [functools.partial(run, **setting)] * CALLS)  # fmt: skip


def sort_rows(batch: int, slots: int, device: torch.device) -> list[dict]:
    """`sort_pairs_by_expert` of 16 random decode calls (ids -1 .. slots - 1): one program
    (a call of one chunk) or one per chunk, at each warp count."""
    generator = torch.Generator().manual_seed(batch * 1000 + slots)
    calls = [torch.randint(-1, slots, (batch, TOP_K), generator=generator, dtype=torch.int32).to(device)
             for _ in range(CALLS)]  # fmt: skip
    block_m = default_tiles(batch * TOP_K, 2048, 768, True)[0]

    def sort(ids: torch.Tensor, programs: str, warps: int):
        return sort_pairs_by_expert(ids, slots, block_m, num_warps=warps, one_program=programs == "one")

    def outputs(setting: dict) -> list[torch.Tensor]:
        routings = [sort(ids, **setting) for ids in calls]
        return [t for routing in routings for t in (routing.pair_of_row, routing.expert_of_block)]

    launch = sort_launch(batch * TOP_K, slots)
    default = {"programs": "one" if launch.one_program else "chunks", "warps": launch.num_warps}
    programs = ("one", "chunks") if launch.num_chunks == 1 else ("chunks",)  # one program sorts one chunk only
    settings = [default, *[{"programs": p, "warps": w} for p in programs for w in SORT_WARPS]]
    row = {"kernel": "pair sort", "size": f"B={batch}", "ids": batch * TOP_K, "slots": slots, "block": block_m}
    return compared(row, [s for i, s in enumerate(settings) if s not in settings[:i]], outputs,
                    lambda setting: [functools.partial(sort, ids, **setting) for ids in calls])  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (a bad one: one line on stderr, exit status 2)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 128])
    parser.add_argument("--kernels", nargs="+", choices=("admission", "sort"), default=["admission", "sort"])
    args = parser.parse_args(argv)
    if min(args.tokens) <= admission.SMALL_CALL // TOP_K:
        parser.exit(2, f"bench_routing_launches: error: --tokens must exceed {admission.SMALL_CALL // TOP_K} "
                       "(calls the large-call kernel serves)\n")  # fmt: skip
    if min(args.batch_sizes) < 1:
        parser.exit(2, "bench_routing_launches: error: --batch-sizes must be >= 1\n")
    return args


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_routing_launches: error: needs a CUDA GPU (it times CUDA-graph replays)", file=sys.stderr)
        return 2
    device, rows = torch.device("cuda"), []
    print(f"{torch.cuda.get_device_name()}: graphed, {CALLS} calls, median us a call; ratio to the default setting")
    try:  # a run cut short keeps what it measured
        for tokens in args.tokens if "admission" in args.kernels else []:
            rows += admission_rows(tokens, device)
        for batch, slots in itertools.product(args.batch_sizes, SORT_SLOTS) if "sort" in args.kernels else []:
            rows += sort_rows(batch, slots, device)
    finally:
        if rows:
            print_table(rows, COLUMNS)
            print("CSV:", append_csv("bench_routing_launches", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
