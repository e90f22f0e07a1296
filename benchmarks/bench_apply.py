"""Expert apply kernels side by side at Qwen3-30B-A3B shapes: GEMV vs grouped GEMM, slots vs all experts.

Variants (one process, same inputs, bf16, H=2048, I=768, K=8, E=128):
  gemv           moe_apply over a pool of N slots (T <= 256: it re-reads an expert per pair)
  grouped        moe_apply_grouped over the pool of N slots
  grouped_all    moe_apply_grouped over all E resident experts, the same routing in expert ids
  torch_grouped  torch._grouped_mm on tokens sorted by slot (the peer; skipped if missing)

Routing: top-K distinct slots per token, uniform over the N slots (N = E: over all experts).
Each variant is captured once in a CUDA graph and replayed (graph_ms), and run eagerly
(eager_ms). Bound: max(bytes of the distinct experts touched / measured HBM bandwidth,
FLOPs / 989 TFLOP/s dense bf16). The recommended `GROUPED_MIN_PAIRS` is the smallest T*K
from which grouped beats gemv (graphed) at every larger measured T, over every pool.

    python benchmarks/bench_apply.py [--quick] [--pools 32 64 128] [--block-m 32]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_csv, cuda_time_ms, print_table  # noqa: E402

from expertcache.kernels import moe_apply, moe_apply_grouped  # noqa: E402

HIDDEN, INTER, TOP_K, EXPERTS = 2048, 768, 8, 128
BF16_TFLOPS = 989.0  # H200 dense bf16, datasheet
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
QUICK_TOKENS = (1, 8, 64, 256, 1024)
GEMV_MAX_TOKENS = 256


def hbm_gbps(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth, bytes read plus written, GB/s."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = cuda_time_ms(lambda: target.copy_(source), repeats=10)
    return 2 * nbytes / ms / 1e6


def torch_grouped(hidden, w1, w2, topk_weights, topk_ids):
    """The peer: the same MLP with ``torch._grouped_mm`` on (token, choice) pairs sorted by id.

    All ids must be in ``[0, N)``. ``w1``/``w2`` are ``[N, 2I, H]`` / ``[N, H, I]``, passed
    transposed (``mat_b`` is ``[G, K, N]``), so no weight is copied.
    """
    tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.searchsorted(flat[order], torch.arange(1, w1.shape[0] + 1, device=flat.device)).int()
    gate_up = torch._grouped_mm(hidden[order // top_k], w1.transpose(1, 2), offs=ends)
    gate, up = gate_up.chunk(2, dim=-1)
    down = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=ends)
    weighted = down.float() * topk_weights.reshape(-1)[order, None].float()
    per_choice = torch.empty_like(weighted).index_copy_(0, order, weighted).view(tokens, top_k, -1)
    return per_choice.sum(dim=1).to(hidden.dtype)


def graph_of(run: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``run`` captured once (after a warm call on a side stream, which compiles the kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def variants(pool, full, slot_to_expert, hidden, router, slot_ids, block_m, with_gemv, with_peer) -> dict:
    expert_ids = slot_to_expert[slot_ids]
    runs = {
        "grouped": lambda: moe_apply_grouped(hidden, *pool, router, slot_ids, block_m=block_m),
        "grouped_all": lambda: moe_apply_grouped(hidden, *full, router, expert_ids, block_m=block_m),
    }
    if with_gemv:
        runs["gemv"] = lambda: moe_apply(hidden, *pool, router, slot_ids)
    if with_peer:
        runs["torch_grouped"] = lambda: torch_grouped(hidden, *pool, router, slot_ids)
    return runs


def measure(runs: dict, repeats: int) -> list[dict]:
    rows = []
    for name, run in runs.items():
        graph = graph_of(run)
        rows.append({"variant": name, "graph_ms": cuda_time_ms(graph.replay, repeats),
                     "eager_ms": cuda_time_ms(run, repeats)})  # fmt: skip
        del graph
    return rows


def bound_ms(slot_ids: torch.Tensor, gbps: float) -> tuple[int, float]:
    """(distinct experts touched, the physical bound in ms) of one call."""
    distinct = int(torch.unique(slot_ids).numel())
    weight_bytes = distinct * 3 * HIDDEN * INTER * 2
    flops = 2 * slot_ids.numel() * 3 * HIDDEN * INTER
    return distinct, max(weight_bytes / (gbps * 1e6), flops / (BF16_TFLOPS * 1e9))


def crossover(rows: list[dict]) -> int | None:
    """Smallest T*K of a pool from which grouped beats gemv (graphed) at every larger measured T."""
    graph = {(r["tokens"], r["variant"]): r["graph_ms"] for r in rows}
    measured = sorted(t for t, v in graph if v == "gemv")
    wins = [graph[(t, "grouped")] < graph[(t, "gemv")] for t in measured]
    for index, tokens in enumerate(measured):
        if all(wins[index:]):
            return tokens * TOP_K
    return None


def check_peer(pool, hidden, router, slot_ids) -> str:
    """'' when the peer runs and agrees with moe_apply, else why it is skipped."""
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm missing"
    try:
        ours, peer = moe_apply(hidden, *pool, router, slot_ids), torch_grouped(hidden, *pool, router, slot_ids)
    except RuntimeError as error:
        return f"torch._grouped_mm failed: {str(error).splitlines()[0]}"
    error = ((ours.float() - peer.float()).abs().max() / ours.float().abs().max()).item()
    return "" if error < 2e-2 else f"torch_grouped disagrees with moe_apply (max error {error:.3g} of the largest)"


def expert_weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """All E experts' ``w1`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]``, bf16, resident."""
    w1 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen, dtype=torch.bfloat16)
    return w1 * HIDDEN**-0.5, w2 * INTER**-0.5


def sweep(pools, tokens_list, gbps: float, args) -> tuple[list[dict], str]:
    """Rows of every (pool, T, variant), and why the peer was skipped ('' if it ran)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    full = expert_weights(gen)
    rows, peer_note = [], None
    for num_slots in pools:
        slot_to_expert = torch.randperm(EXPERTS, device="cuda", generator=gen)[:num_slots]
        pool = (full[0][slot_to_expert].contiguous(), full[1][slot_to_expert].contiguous())
        for tokens in tokens_list:
            slot_ids = torch.rand(tokens, num_slots, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
            hidden = torch.randn(tokens, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
            router = torch.rand(tokens, TOP_K, device="cuda", generator=gen)
            if peer_note is None:
                peer_note = check_peer(pool, hidden, router, slot_ids)
            runs = variants(pool, full, slot_to_expert, hidden, router, slot_ids, args.block_m,
                            tokens <= GEMV_MAX_TOKENS, not peer_note)  # fmt: skip
            distinct, bound = bound_ms(slot_ids, gbps)
            for row in measure(runs, args.repeats):
                rows.append({"pool": num_slots, "tokens": tokens, "pairs": tokens * TOP_K, "distinct": distinct,
                             **row, "bound_ms": bound, "graph_vs_bound": row["graph_ms"] / bound})  # fmt: skip
        del pool
        torch.cuda.empty_cache()
    return rows, peer_note or ""


def recommend(rows: list[dict], pools) -> None:
    points = {pool: crossover([r for r in rows if r["pool"] == pool]) for pool in pools}
    found = ", ".join(f"pool {p}: {c if c is not None else 'none measured'}" for p, c in points.items())
    print(f"\ncrossover T*K (grouped faster than gemv, graphed, from there on): {found}")
    if all(c is not None for c in points.values()):
        print(f"recommended GROUPED_MIN_PAIRS = {max(points.values())}")
    else:
        print(f"recommended GROUPED_MIN_PAIRS: above {GEMV_MAX_TOKENS * TOP_K} (gemv not beaten where measured)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS}, pools 32 and 128")
    parser.add_argument("--pools", type=int, nargs="+", default=None, help="slot pool sizes (default 32 64 128)")
    parser.add_argument("--block-m", type=int, default=None, help="grouped block_m (default: the launcher's)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_apply needs a CUDA GPU")
    tokens_list = QUICK_TOKENS if args.quick else TOKENS
    pools = args.pools or ([32, EXPERTS] if args.quick else [32, 64, EXPERTS])
    gbps = hbm_gbps()
    print(f"{torch.cuda.get_device_name()}: HBM copy {gbps:.0f} GB/s (read + written), bf16 {BF16_TFLOPS} TFLOP/s")
    rows, peer_note = sweep(pools, tokens_list, gbps, args)
    if peer_note:
        print(f"torch_grouped skipped: {peer_note}")
    columns = ["pool", "tokens", "pairs", "distinct", "variant", "graph_ms", "eager_ms", "bound_ms", "graph_vs_bound"]
    title = (f"expert apply, Qwen3-30B-A3B shapes (H={HIDDEN}, I={INTER}, K={TOP_K}), bf16; bound = "
             f"max(distinct experts' bytes / {gbps:.0f} GB/s, FLOPs / {BF16_TFLOPS} TFLOP/s)")  # fmt: skip
    print_table(rows, columns, title=title)
    recommend(rows, pools)
    block_m = args.block_m or ""
    append_csv("bench_apply", [{"shape": "Qwen3-30B-A3B", "hbm_gbps": gbps, "block_m": block_m, **r} for r in rows])


if __name__ == "__main__":
    main()
