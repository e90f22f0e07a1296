"""How fast can SMs read pinned host memory? The ceiling of any device-driven copy.

Device mode copies misses with a kernel that reads mapped pinned memory (the plan is on
the GPU, so no host can hand the copy engine its addresses). This script asks whether any
such kernel gets closer to the copy engine than ours: a flat copy of a burst's bytes, host
-> GPU, timed inside a CUDA graph (``BURSTS`` bursts from other host offsets back to back,
as the layers of a decode step), over a grid of kernel shapes, load cache modifiers and
chunks per iteration, against the copy engine's captured memcpy of the same bytes and our
`copy_experts` at its default. `--tma`: kernels whose reads are Hopper's tensor-memory-
accelerator loads (Triton tensor descriptors over the mapped host buffer, ``[rows, 64]``
words, one box of ``[R, 64]`` at a time), stored by TMA or by plain stores; every variant's
last burst is checked equal to its source.

Physical bound: the copy engine's pinned bandwidth (the step bound of `bench_decode.py`).

    python benchmarks/bench_sm_reads.py [--mb 9.44 75.5] [--tma] [--no-flat]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_csv, cuda_time_ms, print_table  # noqa: E402

from expertcache.kernels.copy_experts import (  # noqa: E402
    DEFAULT_BLOCK,
    DEFAULT_PROGRAMS,
    CopyPlan,
    MappedHostPointer,
    build_segments,
    copy_experts,
)

BURSTS = 10


@triton.jit
def _flat_copy_kernel(
    source_ptr, target_ptr, words, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr, UNROLL: tl.constexpr,
    MODIFIER: tl.constexpr,
):  # fmt: skip
    lanes = tl.arange(0, BLOCK)
    for start in range(tl.program_id(0) * BLOCK * UNROLL, words, PROGRAMS * BLOCK * UNROLL):
        for part in tl.static_range(UNROLL):  # UNROLL independent loads in flight, then their stores
            offsets = tl.max_contiguous(tl.multiple_of(start + part * BLOCK + lanes, 4), BLOCK)
            mask = offsets < words
            value = tl.load(source_ptr + offsets, mask=mask, cache_modifier=MODIFIER)
            tl.store(target_ptr + offsets, value, mask=mask)


@triton.jit
def _tma_copy_kernel(
    source, target, target_ptr, rows,
    BOX: tl.constexpr, PROGRAMS: tl.constexpr, STAGES: tl.constexpr, TMA_STORE: tl.constexpr,
):  # fmt: skip
    for start in tl.range(tl.program_id(0) * BOX, rows, PROGRAMS * BOX, num_stages=STAGES):
        value = source.load([start, 0])
        if TMA_STORE:
            target.store([start, 0], value)
        else:
            offsets = (start + tl.arange(0, BOX))[:, None] * 64 + tl.arange(0, 64)[None, :]
            tl.store(target_ptr + offsets, value, mask=offsets < rows * 64)


def tma_variants(bursts: list, target: torch.Tensor, words: int) -> dict:
    """Milliseconds of each TMA read kernel (or the error that stopped it), each checked equal."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = words // 64
    results = {}
    for box, programs, stages, tma_store in itertools.product((64, 128), (32, 66, 132), (1, 3), (True, False)):
        label = f"tma {programs}x[{box},64], {stages} stages, {'tma' if tma_store else 'plain'} stores"
        sources = [TensorDescriptor(MappedHostPointer(b, torch.int32), [rows, 64], [64, 1], [box, 64]) for b in bursts]
        destination = TensorDescriptor(target, [rows, 64], [64, 1], [box, 64])

        def run(box=box, programs=programs, stages=stages, tma_store=tma_store, sources=sources, into=destination):
            for source in sources:
                _tma_copy_kernel[(programs,)](source, into, target, rows, BOX=box, PROGRAMS=programs,
                                              STAGES=stages, TMA_STORE=tma_store, num_warps=4)  # fmt: skip

        try:
            target.zero_()
            results[label] = graph_ms(run)
            if not torch.equal(target.cpu(), bursts[-1][: rows * 64]):
                results[label] = float("nan")
                print(f"{label}: the copy is WRONG", flush=True)
        except Exception as error:  # noqa: BLE001 - a variant the hardware or Triton refuses is reported, not fatal
            print(f"{label}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", flush=True)
    return results


def graph_ms(enqueue, repeats: int = 20) -> float:
    """Milliseconds of one replay of a CUDA graph holding ``enqueue()``'s launches."""
    enqueue()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        enqueue()
    return cuda_time_ms(graph.replay, repeats=repeats)


def sweep(mb: float, flat_variants: bool = True, tma: bool = False) -> list[dict]:
    """Every variant on bursts of ``mb`` megabytes."""
    words = int(mb * 1e6) // 256 * 64  # int32 words, a multiple of 256 bytes (TMA's 64-word rows)
    host = torch.empty(BURSTS * words, dtype=torch.int32).pin_memory()
    host.random_()
    target = torch.empty(words, dtype=torch.int32, device="cuda")
    bursts = [host[b * words : (b + 1) * words] for b in range(BURSTS)]
    results = {"copy engine (memcpy)": graph_ms(lambda: [target.copy_(burst, non_blocking=True) for burst in bursts])}
    # our kernel at its default: the bursts as experts 0..9 of a one-tensor store
    segments = build_segments((0,), (words * 4,), 4, DEFAULT_BLOCK)
    plans = [CopyPlan(torch.tensor([1], device="cuda"), torch.tensor([b], device="cuda"),
                      torch.zeros(1, dtype=torch.int64, device="cuda"), 1) for b in range(BURSTS)]  # fmt: skip
    flat = host.view(torch.uint8)
    results[f"copy_experts {DEFAULT_PROGRAMS}x{DEFAULT_BLOCK}"] = graph_ms(
        lambda: [copy_experts(flat, [target[None]], plan, segments, unit=4, num_experts=BURSTS) for plan in plans]
    )
    sources = [MappedHostPointer(burst, torch.int32) for burst in bursts]
    shapes = [(64, 4096, 8), (132, 4096, 8), (132, 2048, 4), (132, 1024, 4), (264, 1024, 2), (64, 4096, 16)]
    if not flat_variants:
        shapes = []
    if tma:
        results.update(tma_variants(bursts, target, words))
    for (programs, block, warps), unroll, modifier in itertools.product(shapes, (1, 2, 4), ("", ".cg", ".cv")):
        if unroll > 1 and modifier:
            continue  # modifiers are compared at one chunk per iteration
        label = f"flat {programs}x{block}, {warps} warps, unroll {unroll}{', ' + modifier if modifier else ''}"

        def run(programs=programs, block=block, warps=warps, unroll=unroll, modifier=modifier):
            for source in sources:
                _flat_copy_kernel[(programs,)](source, target, words, BLOCK=block, PROGRAMS=programs,
                                               UNROLL=unroll, MODIFIER=modifier, num_warps=warps)  # fmt: skip

        results[label] = graph_ms(run)
    engine = results["copy engine (memcpy)"]
    nbytes = BURSTS * words * 4
    return [
        {"burst_mb": round(words * 4 / 1e6, 2), "variant": variant, "gbps": nbytes / ms / 1e6, "vs_engine": engine / ms}
        for variant, ms in results.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[9.44, 75.5], help="burst sizes (MB)")
    parser.add_argument("--tma", action="store_true", help="add kernels reading by TMA (tensor descriptors; sm_90+)")
    parser.add_argument("--no-flat", action="store_true", help="leave out the flat kernels' grid of shapes")
    args = parser.parse_args()
    rows = [row for mb in args.mb for row in sweep(mb, flat_variants=not args.no_flat, tma=args.tma)]
    title = f"pinned host -> GPU reads in a CUDA graph ({BURSTS} bursts); bound: the copy engine"
    print_table(rows, ["burst_mb", "variant", "gbps", "vs_engine"], title=title)
    append_csv("bench_sm_reads", rows)


if __name__ == "__main__":
    main()
