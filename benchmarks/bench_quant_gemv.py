"""The quantised decode GEMV's tiles: where `moe_apply_quant`'s time goes at T = 1..16, and which tile is fastest.

Three expert formats at real model shapes, random weights, each launch timed inside a CUDA
graph of 16 calls with 16 different routings (the L2 cache holds no call's experts for the
next one), side by side in one process::

    fp8 qwen3     Qwen3-30B-A3B-FP8: H=2048, I=768, 128 experts, top-8, e4m3, 128x128 block scales
    mxfp4 gpt-oss GPT-OSS-20B: H=I=2880, 32 experts, top-4, MXFP4 + biases, clamped SwiGLU
    bf16 gpt-oss  the same MLP on 16-bit weights (`GPT_OSS_BF16`, format "none")

Variants per format and T:

    gate_up, down          `quant_apply`'s kernels (`launch_gate_up`, `launch_down`) at every
                           tile tried: output rows, the longest K piece (fp8: inside a scale
                           column), pieces a step (fp8, 16-bit: "16x128x4" = 4 pieces of 128),
                           warps, and whether the scaled products are reduced after every step
                           ("per step") or accumulated elementwise and reduced once ("once")
    moe_apply_quant_passes the whole apply with the library's tiles (`gate_up_tile`, `DOWN_TILES`),
                           GEMV and grouped GEMM

Bound: the bytes of the distinct experts a launch reads (weights, scales, biases) / the
measured HBM rate (a 2 GiB device-to-device copy, read + written). Prints the fastest tile of
each kernel per (format, T), the library's tiles, and appends every row to
`results/bench_quant_gemv.csv`.

    python benchmarks/bench_quant_gemv.py [--tokens 1 2 4 8 16] [--formats fp8 mxfp4 bf16] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_csv, print_table  # noqa: E402
from bench_apply import hbm_gbps  # noqa: E402
from bench_gemv_tiles import graphed_us, usage_problem  # noqa: E402

from expertcache.kernels import moe_apply_quant_passes  # noqa: E402
from expertcache.kernels.quant_apply import (  # noqa: E402
    DOWN_TILES,
    GATE_UP_TILES,
    SMALL_CALL_GATE_UP_TILES,
    Tile,
    gate_up_tile,
    launch_down,
    launch_gate_up,
)
from expertcache.kernels.quant_common import FORMAT_CODES, quant_operands  # noqa: E402
from expertcache.provider import result_from_tensors  # noqa: E402
from expertcache.quant import FP8_BLOCK_128, GPT_OSS_BF16, GPT_OSS_MXFP4  # noqa: E402
from expertcache.quant_tensors import quantize_experts  # noqa: E402

FORMATS = {
    "fp8 qwen3": dict(scheme=FP8_BLOCK_128, experts=128, hidden=2048, inter=768, top_k=8),
    "mxfp4 gpt-oss": dict(scheme=GPT_OSS_MXFP4, experts=32, hidden=2880, inter=2880, top_k=4),
    "bf16 gpt-oss": dict(scheme=GPT_OSS_BF16, experts=32, hidden=2880, inter=2880, top_k=4),
}
CALLS = 16


def experts_of(shape: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The format's tensors of ``shape["experts"]`` random experts, quantised 8 at a time on the GPU."""
    E, H, inter, scheme = shape["experts"], shape["hidden"], shape["inter"], shape["scheme"]
    gen = torch.Generator(device).manual_seed(0)
    parts: dict[str, list] = {}
    for start in range(0, E, 8):
        count = min(8, E - start)
        w1 = torch.randn(count, 2 * inter, H, device=device, generator=gen) * H**-0.5
        w2 = torch.randn(count, H, inter, device=device, generator=gen) * inter**-0.5
        biases = (None, None)
        if scheme.has_bias:
            biases = (torch.randn(count, 2 * inter, device=device, generator=gen) * 0.1,
                      torch.randn(count, H, device=device, generator=gen) * 0.1)  # fmt: skip
        dtype = {"dtype": torch.bfloat16} if scheme.format == "none" else {}
        for name, tensor in quantize_experts(scheme, w1, w2, *biases, **dtype).items():
            parts.setdefault(name, []).append(tensor)
    return {name: torch.cat(chunks).contiguous() for name, chunks in parts.items()}


def expert_bytes(tensors: dict[str, torch.Tensor], prefix: str) -> int:
    """Bytes one expert holds in the tensors of one projection (``w1*`` or ``w2*``)."""
    return sum(t[0].numel() * t.element_size() for name, t in tensors.items() if name.startswith(prefix))


def tiles(quick: bool, pieces: bool) -> list[Tile]:
    """The tiles tried for each kernel: the library's, the tile before the sweep, and a grid;
    with ``pieces`` (fp8, 16-bit) also K steps of 2 and 4 pieces."""
    if quick:
        grid = [Tile(8, 128, 8, True), Tile(16, 256, 4, True)]
        grid += [Tile(16, 128, 8, True, chunks=4)] if pieces else []
    else:
        shapes = itertools.product((4, 8, 16, 32), (64, 128, 256), (4, 8))
        grid = [Tile(rows, step, warps, True) for rows, step, warps in shapes if rows * step <= 1024 * warps]
        if pieces:
            shapes = itertools.product((8, 16, 32), (2, 4), (4, 8))
            grid += [Tile(rows, 128, warps, True, chunks) for rows, chunks, warps in shapes
                     if rows * 128 * chunks <= 1024 * warps]  # fmt: skip
    tables = (GATE_UP_TILES, SMALL_CALL_GATE_UP_TILES, DOWN_TILES)
    seen = {tile for table in tables for tile in table.values()} | {Tile(16, 256, 4, False)}
    return sorted(tile for tile in seen | set(grid) if pieces or tile.chunks == 1)


def tile_name(tile: Tile) -> str:
    """``rows x piece [x pieces] w warps, once | per step``, e.g. ``16x128x4 w8 once``."""
    pieces = f"x{tile.chunks}" if tile.chunks > 1 else ""
    return f"{tile.rows}x{tile.max_step}{pieces} w{tile.warps} {'once' if tile.sum_once else 'per step'}"


def rows_for(label: str, shape: dict, tensors: dict, tokens: int, hbm: float, candidates: list[Tile]) -> list[dict]:
    """Every variant and tile of one format at ``tokens`` tokens: microseconds a call, and its bound."""
    device = tensors["w1"].device
    E, H, inter, top_k, scheme = shape["experts"], shape["hidden"], shape["inter"], shape["top_k"], shape["scheme"]
    gens = [torch.Generator().manual_seed(call) for call in range(CALLS)]
    ids = [torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)]).to(device, torch.int32)
           for g in gens]  # fmt: skip
    hidden = [torch.randn(tokens, H, device=device).to(torch.bfloat16) for _ in range(CALLS)]
    router = [torch.rand(tokens, top_k, device=device) for _ in range(CALLS)]
    ops = [quant_operands(hidden[c], tensors, router[c], ids[c], scheme) for c in range(CALLS)]
    distinct = sum(int(call_ids.unique().numel()) for call_ids in ids) / CALLS
    w1_bytes, w2_bytes = expert_bytes(tensors, "w1"), expert_bytes(tensors, "w2")
    act = torch.empty(tokens * top_k, inter, device=device)
    part = torch.empty(tokens * top_k, H, device=device)
    rows = []

    def record(variant: str, tile: str, launch, nbytes: int) -> None:
        us = graphed_us([functools.partial(launch, call) for call in range(CALLS)])
        bound = distinct * nbytes / (hbm * 1e3)
        rows.append(dict(format=label, tokens=tokens, variant=variant, tile=tile, us=us, bound_us=bound,
                         ratio=us / bound))  # fmt: skip

    def whole(call, kernel):
        result = result_from_tensors(tensors, ids[call])
        moe_apply_quant_passes(hidden[call], [result], router[call], scheme=scheme, kernel=kernel)

    for kernel in ("gemv", "grouped"):
        record(f"moe_apply_quant_passes {kernel}", "", functools.partial(whole, kernel=kernel), w1_bytes + w2_bytes)
    for tile in candidates:
        name = tile_name(tile)
        record("gate_up", name, lambda c, t=tile: launch_gate_up(hidden[c], ops[c], ids[c], act, t), w1_bytes)
        record("down", name, lambda c, t=tile: launch_down(act, ops[c], ids[c], router[c], part, True, t), w2_bytes)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    short = {label.split()[0]: label for label in FORMATS}  # fp8, mxfp4, bf16
    parser.add_argument("--formats", nargs="+", choices=list(short), default=list(short))
    parser.add_argument("--quick", action="store_true", help="a few tiles only")
    args = parser.parse_args()
    problem = usage_problem(args.tokens)
    if problem:
        print(f"bench_quant_gemv.py: {problem}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    hbm = hbm_gbps()
    rows = []
    for label in (short[name] for name in args.formats):
        shape = FORMATS[label]
        tensors = experts_of(shape, device)
        for tokens in args.tokens:
            candidates = tiles(args.quick, pieces=shape["scheme"].format != "mxfp4")
            rows += rows_for(label, shape, tensors, tokens, hbm, candidates)
            print(f"  {label} T={tokens} done", flush=True)
        del tensors
        torch.cuda.empty_cache()
    best, library = {}, []
    for entry in rows:  # the fastest tile of each kernel per (format, T), and every whole-apply row
        key = (entry["format"], entry["tokens"], entry["variant"])
        if key not in best or entry["us"] < best[key]["us"]:
            best[key] = entry
        code = FORMAT_CODES[FORMATS[entry["format"]]["scheme"].format]
        tile = {"gate_up": gate_up_tile(code, entry["tokens"]), "down": DOWN_TILES[code]}.get(entry["variant"])
        if tile is not None and entry["tile"] == tile_name(tile):
            library.append(entry)
    print("CSV:", append_csv("bench_quant_gemv", [{**entry, "hbm_gbps": hbm} for entry in rows]))
    columns = ["format", "tokens", "variant", "tile", "us", "bound_us", "ratio"]
    print(f"HBM {hbm:.0f} GB/s (read + written); bf16 tokens, graphed; fastest tile per kernel:")
    print_table(list(best.values()), columns)
    print("the library's tiles (`quant_apply.gate_up_tile`, `DOWN_TILES`):")
    print_table(library, columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
