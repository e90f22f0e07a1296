"""The decode GEMV's tiles: where `moe_apply`'s time goes at T = 1..8, and which tile is fastest.

Qwen3-30B-A3B expert shapes (H=2048, I=768, K=8, E=128 resident experts), bf16, each
launch timed inside a CUDA graph of 16 calls with 16 different routings (so the L2 cache
holds no call's experts for the next one). Side by side in one process:

    gate_up per-step sum   the gate_up kernel before c8c1257 (defined here as the baseline):
                           a 16 x 256 tile whose products are reduced after every K step
    gate_up                `expert_apply._gate_up_kernel` (products accumulated elementwise,
                           reduced once), every (rows, columns, warps, stages) tile tried
    down                   `expert_apply._down_kernel`, every (rows, columns, warps) tile
    moe_apply_passes       the whole apply (gate_up, down, sum over k; `expert_apply.GATE_UP_TILE`
                           and `DOWN_TILE`), GEMV and grouped GEMM

Bound: the bytes of the distinct experts a launch reads / the measured HBM rate (a 2 GiB
device-to-device copy, read + written). Prints the table and appends `results/bench_gemv_tiles.csv`.

    python benchmarks/bench_gemv_tiles.py [--tokens 1 2 4 8] [--quick]

(`results/logs/gemv_tiles_run20_8f6641e.log` is the run behind `GATE_UP_TILE`, made with this
script's first form, whose "current" kernel was the per-step-sum baseline here.)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_csv, print_table  # noqa: E402
from bench_apply import hbm_gbps  # noqa: E402

from expertcache.kernels import expert_apply, moe_apply_passes  # noqa: E402
from expertcache.result import ExpertWeightResult  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K, CALLS = 128, 2048, 768, 8, 16


@triton.jit
def _gate_up_per_step_sum(
    hidden_ptr, w1_ptr, ids_ptr, act_ptr, hidden_size, inter_size, top_k, stride_token, stride_expert, stride_row,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """The baseline: `expert_apply._gate_up_kernel` before c8c1257 (no scales, no PDL)."""
    pair = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    row_mask = rows < inter_size
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    gate = tl.zeros([BLOCK_I], dtype=tl.float32)
    up = tl.zeros([BLOCK_I], dtype=tl.float32)
    x_row = hidden_ptr + (pair // top_k) * stride_token
    gate_rows = w1_ptr + expert * stride_expert + rows.to(tl.int64)[:, None] * stride_row
    up_rows = gate_rows + inter_size * stride_row
    for start in range(0, hidden_size, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_mask = cols < hidden_size
        x = tl.load(x_row + cols, mask=col_mask, other=0.0).to(tl.float32)
        mask = row_mask[:, None] & col_mask[None, :]
        g = tl.load(gate_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gate += tl.sum(g * x[None, :], axis=1)
        up += tl.sum(u * x[None, :], axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + pair * inter_size + rows, act, mask=row_mask)


def usage_problem(tokens: list[int]) -> str | None:
    """Why a tile sweep over ``tokens`` cannot run here (no GPU, a count below 1), or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if any(t < 1 for t in tokens):
        return "--tokens must be >= 1"
    return None


def graphed_us(calls) -> float:
    """Median microseconds per call of ``calls`` (a list of thunks) captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(18):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[3:])[len(times[3:]) // 2] / len(calls) * 1e3


def rows_for(tokens: int, w1, w2, hbm: float, gate_tiles, down_tiles) -> list[dict]:
    """Every variant and tile at ``tokens`` tokens: microseconds a call, and its bound."""
    device, pairs = w1.device, tokens * TOP_K
    gens = [torch.Generator().manual_seed(call) for call in range(CALLS)]
    ids = [
        torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)]).to(device, torch.int32)
        for g in gens
    ]
    hidden = [torch.randn(tokens, HIDDEN, device=device).to(torch.bfloat16) for _ in range(CALLS)]
    router = [torch.rand(tokens, TOP_K, device=device) for _ in range(CALLS)]
    distinct = sum(int(call_ids.unique().numel()) for call_ids in ids) / CALLS
    act = torch.empty(pairs, INTER, device=device)
    part = torch.empty(pairs, HIDDEN, device=device)
    rows = []

    def record(variant: str, tile: str, launch, share: float) -> None:
        us = graphed_us([functools.partial(launch, call) for call in range(CALLS)])
        bound = distinct * 3 * HIDDEN * INTER * 2 * share / (hbm * 1e3)
        rows.append(dict(tokens=tokens, variant=variant, tile=tile, us=us, bound_us=bound, ratio=us / bound))

    def whole(call, kernel):
        moe_apply_passes(hidden[call], [ExpertWeightResult(w1, w2, ids[call])], router[call], kernel=kernel)

    def baseline(call):
        _gate_up_per_step_sum[(pairs, triton.cdiv(INTER, 16))](
            hidden[call], w1, ids[call], act, HIDDEN, INTER, TOP_K, hidden[call].stride(0), w1.stride(0), w1.stride(1),
            BLOCK_I=16, BLOCK_H=256,
        )  # fmt: skip

    def gate_up(call, tile):
        block_rows, block_cols, warps, stages = tile
        expert_apply._gate_up_kernel[(pairs, triton.cdiv(INTER, block_rows))](
            hidden[call], w1, w1, ids[call], act, HIDDEN, INTER, TOP_K, EXPERTS, hidden[call].stride(0),
            w1.stride(0), w1.stride(1), 0, 0, BLOCK_I=block_rows, BLOCK_H=block_cols, HAS_SCALE=False,
            SCALE_BLOCK=128, PDL=False, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    def down(call, tile):
        block_rows, block_cols, warps = tile
        expert_apply._down_kernel[(pairs, triton.cdiv(HIDDEN, block_rows))](
            act, w2, w2, ids[call], router[call], part, HIDDEN, INTER, EXPERTS, w2.stride(0), w2.stride(1), 0, 0,
            BLOCK_H=block_rows, BLOCK_I=block_cols, HAS_SCALE=False, SCALE_BLOCK=128, WRITE_ALL=True, PDL=False,
            num_warps=warps,
        )  # fmt: skip

    for kernel in ("gemv", "grouped"):
        record(f"moe_apply_passes {kernel}", "", functools.partial(whole, kernel=kernel), 1.0)
    record("gate_up per-step sum", "16x256 w4 s3", baseline, 2 / 3)
    for tile in gate_tiles:
        record("gate_up", "{}x{} w{} s{}".format(*tile), functools.partial(gate_up, tile=tile), 2 / 3)
    for tile in down_tiles:
        record("down", "{}x{} w{}".format(*tile), functools.partial(down, tile=tile), 1 / 3)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--quick", action="store_true", help="a few tiles only")
    args = parser.parse_args()
    problem = usage_problem(args.tokens)
    if problem:
        print(f"bench_gemv_tiles.py: {problem}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    w1 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device=device) * 0.02).to(torch.bfloat16)
    hbm = hbm_gbps()
    if args.quick:
        gate_tiles, down_tiles = [(8, 128, 8, 3), (16, 256, 4, 3), (16, 128, 8, 3)], [(16, 256, 4), (16, 128, 4)]
    else:
        gate_tiles = [t for t in itertools.product((4, 8, 16, 32), (128, 256, 512, 1024), (4, 8), (1, 3))
                      if t[0] * t[1] <= 2048 * t[2]]  # fmt: skip
        down_tiles = [t for t in itertools.product((4, 8, 16, 32, 64), (128, 256, 512), (4, 8))
                      if t[0] * t[1] <= 2048 * t[2]]  # fmt: skip
    rows = [row for tokens in args.tokens for row in rows_for(tokens, w1, w2, hbm, gate_tiles, down_tiles)]
    best = {}
    for entry in rows:  # the fastest tile of each kernel per T, and every whole-apply row
        key = (entry["tokens"], entry["variant"])
        if key not in best or entry["us"] < best[key]["us"]:
            best[key] = entry
    print(f"HBM {hbm:.0f} GB/s (read + written); Qwen3-30B-A3B shapes, bf16, graphed; fastest tile per kernel:")
    print_table(list(best.values()), ["tokens", "variant", "tile", "us", "bound_us", "ratio"])
    print(f"library tiles: gate_up {expert_apply.GATE_UP_TILE}, down {expert_apply.DOWN_TILE} (rows, columns, warps)")
    print("CSV:", append_csv("bench_gemv_tiles", [{**entry, "hbm_gbps": hbm} for entry in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
