"""Decode throughput against batch size: the expert cache vs whole-layer streaming vs all resident.

Qwen3-30B-A3B expert shapes (H=2048, I=768, E=128, top-8, bf16, 9.4 MB per expert), 12
layers, routing replayed from the real Qwen3 trace: a batch of B requests is B trace
positions spread over the trace, and row b of step s is trace token ``offset_b + s``. One
process, one set of pinned stores shared by every variant, one apply kernel
(`moe_apply_passes`: GEMV below 128 pairs, grouped GEMM above; ``--apply gemv``: GEMV only)::

    resident         every expert on the GPU (FullGPUProvider), CUDA graph
    stream d1, d2    whole-layer streaming, prefetch 1 / 2 layers ahead
                     (`layer_streaming.StreamingLayers`, vLLM's prefetch offloader), CUDA graph
    host             host-mode CachedWeightProvider, per-layer pools, eager (not capturable)
    device           device-mode CachedWeightProvider, per-layer pools, CUDA graph
    device global    device mode, one SlotPool shared by all layers (same total slots), CUDA graph
    device coded     device mode, per-layer pools, exponent-coded stores (`expertcache.compression`,
                     ~0.68 of the bytes cross PCIe; decoded into the slots), CUDA graph
    device prefetch  device mode, per-layer pools, and layer l+1's experts prefetched once layer
      R/K            l's router ran (``DecodeStack.step(..., prefetch)``), guessed by an oracle
                     that knows R of the K true ids (the other K - R guesses are wrong ones):
                     what a predictor of that quality could win; small batches (B * K <= slots)
      R/K ahead D    the same, routers handing layer l + D's guesses (``--lookahead``)
      R/K ahead D    ``--across D``: the hand-offs wrap into the next step (``DecodeStack``'s
        across       ``across_steps``), the last D routers starting the next token's first D
                     layers; the oracle knows the next token's routing too (R = K only): how
                     close to the bound a cache gets that never waits for a router
    device copies    device mode, per-layer pools, the step without its expert compute (dense
      only           parts, routers, admissions and copies run; ``--floor``): what no apply,
                     overlap or kernel change can go under, since a layer's copies wait for
                     its router; ``device global copies only``: the same for the shared pool
    dense only       the resident step without its expert compute (dense parts and routers
                     only), CUDA graph: the part of a step no cache can overlap with copies

(`DecodeStack` serves the device variants' calls of at most 1,024 ids with ``passes(ids,
overlap=True)`` on pools smaller than the layer: a call that does not fit runs in overlapped
passes, groups of half the slots, each pass's copies on a side stream while the pass before
computes, and the first pass (the whole call, when it fits) comes as its hits, then its
misses. The ``max_passes`` column is the most passes the call's shape allows.)

at 25% / 50% / 100% of each layer's experts in slots. Each variant warms up, then a run of
steps is timed with CUDA events (one graph per batch size). At 100% the warm-up first steps
over the whole trace, so the timed steps find every expert the trace routes to resident. Physical bound of a step::

    bound = max(resident step time at that batch size, bytes copied per step / pinned bandwidth)

(copies on the copy engine can overlap compute; streaming copies all L*E experts every step,
~14.5 GB, ~0.27 s at 54 GB/s; a cache copies its misses). The bandwidth is the faster of two
measured pinned copy-engine rates: a 64 MiB buffer and one whole layer's store (~1.2 GB, the
rate streaming gets). ratio = step time / bound. ``rel_err``: the max abs difference of one
check step's output from the resident step's (same inputs), over the resident's max abs.

A cache that copies a layer's misses once its router chose them cannot overlap them with that
layer's dense part and router (they come first), nor with the next layer's (its input needs
the copied experts): without speculation a step takes at least its dense parts plus its
copies. ``ratio_to_causal`` divides by that bound::

    causal bound = max(resident step, dense-only step + bytes copied per step / pinned bandwidth)

(``ratio_to_serial``: against resident step + copies, the step with nothing overlapped.)

A coded variant's bound counts the raw bytes of its misses, as every other cache's does (the
same physical limit for moving these weights); ``ratio_to_coded`` divides by the bound of the
coded bytes it moved instead.

``--prefill 1024 4096``: one forward over T consecutive trace tokens instead (eager), at
``--prefill-fraction`` of the experts in slots, fresh (cold) caches, bound = resident forward
+ each touched expert's bytes once / pinned bandwidth. Device mode's eager prefill copies with
the copy engine (its default mover, the plan read back once a pass); ``device kernel mover``
beside it keeps the copy kernel, as inside graphs. ``--profile``: one more forward of each
cache variant under `torch.profiler`; prints where its GPU time goes and how much of the
forward the GPU sat idle.

``--serial 0.25 0.5``: beside the device rows, ``device serial`` rows at those fractions, whose
stack asks for passes one after the other (``overlap=False``): the overlap's gain, measured
in one process. ``--unlanded 0.25 0.5``: ``device unlanded`` rows whose apply waits for each
pass's whole copy instead of each expert's landing count (`expertcache.kernels.landing`): the
counts' gain, in one process. ``--landed-whole 0.25 0.5``: ``device landed whole`` rows whose
landing counts count every name alike, so the GEMV's gate_up waits for a whole expert, not
only its ``w1`` (`expertcache.kernels.landing.Counting`): the split counts' gain, in one
process. ``--overlap off``: every device cache serves so (no
hits-then-misses split, no overlapped passes);
``--chain off``: no programmatic dependent launch between the decode kernels; ``--copy-priority
default``: the pools' copy streams at the default priority, not above the apply's (ablations).

``--dry-run``: the same plumbing on a CPU with tiny shapes and interpreted kernels (fp32,
eager, no graphs), results to a temporary folder: a check, not a measurement.

    python benchmarks/bench_batch.py [--batch-sizes 1 2 4 ...] [--fractions 0.25 0.5 1.0] [--steps 16]
    python benchmarks/bench_batch.py --prefill 1024 4096
    python benchmarks/bench_batch.py --dry-run              (~2 min on a CPU; --prefill 64 for prefill)
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import append_csv, cuda_time_ms, pinned_copy_gbps, print_table, traces_dir  # noqa: E402
from bench_decode import QWEN3_TRACE, qwen3_routing  # noqa: E402
from layer_streaming import StreamingLayers  # noqa: E402
from profile_timeline import load_events, report  # noqa: E402

from expertcache import CachedWeightProvider, CacheStats, FullGPUProvider, SlotPool, slot_pool  # noqa: E402
from expertcache.decode_stack import DecodeStack, GraphedDecodeStep  # noqa: E402
from expertcache.kernels import _launch, landing, moe_apply_passes  # noqa: E402
from expertcache.layout import layout_from_weights  # noqa: E402
from expertcache.passes import max_passes  # noqa: E402
from expertcache.store import CPUBackingStore  # noqa: E402

QWEN3 = dict(name="Qwen3-30B-A3B", hidden=2048, inter=768, experts=128, top_k=8, layers=12, dtype=torch.bfloat16)
TINY = dict(name="tiny (dry run)", hidden=64, inter=32, experts=128, top_k=8, layers=3, dtype=torch.float32)


@dataclasses.dataclass
class Bench:
    """What every variant shares: shape, device, stores, routing source, apply, bandwidth."""

    shape: dict
    device: torch.device
    stores: list[CPUBackingStore]
    trace: np.ndarray  # [N, L, K] expert ids
    apply: Callable | None  # None: DecodeStack's default
    copy_gbps: float  # the bound's bandwidth: the faster of the measured rates (64 MiB, one layer)
    graphs: bool
    coded_stores: list[CPUBackingStore] | None = None  # the same experts, exponent-coded
    fill: bool = True  # caches of every expert warm up over the whole trace (not in a dry run: slow)
    overlap: bool = True  # device caches overlap copies with compute (DecodeStack's overlap)

    @property
    def expert_bytes(self) -> int:
        return self.stores[0].layout.expert_bytes


# -- inputs ----------------------------------------------------------------------------------


#: `DecodeStack`'s own apply over a call's passes (`moe_apply_passes`, kernel chosen by size).
DEFAULT_APPLY = inspect.signature(DecodeStack).parameters["apply"].default


def resolve_apply(choice: str) -> tuple[Callable | None, str]:
    """The apply every variant runs, for `DecodeStack` (None: the stack's default).

    ``default``: the stack's own; ``auto``: `moe_apply_passes` picking GEMV or grouped GEMM
    by call size; ``gemv``: `moe_apply_passes` with the GEMV kernel only.
    """
    if choice == "default":
        return None, DEFAULT_APPLY.__name__
    kernel = "auto" if choice == "auto" else "gemv"
    return functools.partial(moe_apply_passes, kernel=kernel), f"moe_apply_passes(kernel={kernel!r})"


def layer_weights(shape: dict, device: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One layer's random experts ``{"w1": [E, 2I, H], "w2": [E, H, I]}`` on ``device``."""
    E, H, inter, dtype = shape["experts"], shape["hidden"], shape["inter"], shape["dtype"]
    return {
        "w1": (torch.randn(E, 2 * inter, H, device=device, generator=gen, dtype=dtype) * H**-0.5),
        "w2": (torch.randn(E, H, inter, device=device, generator=gen, dtype=dtype) * inter**-0.5),
    }


def batch_routing(trace: np.ndarray, batch: int, steps: int) -> np.ndarray:
    """``[steps, L, B, K]``: request b starts at trace token ``b * N // B``, one token a step."""
    offsets = np.arange(batch) * trace.shape[0] // batch
    tokens = (offsets[None, :] + np.arange(steps)[:, None]) % trace.shape[0]  # [steps, B]
    return trace[tokens].transpose(0, 2, 1, 3)


def prefill_routing(trace: np.ndarray, tokens: int) -> np.ndarray:
    """``[L, T, K]``: trace tokens 0 .. T-1 (wrapping round the trace when it is shorter)."""
    return trace[np.arange(tokens) % trace.shape[0]].transpose(1, 0, 2)


def copy_bandwidth_gbps(store: CPUBackingStore, device: torch.device) -> tuple[float, float]:
    """Pinned host -> GPU copy-engine GB/s of a 64 MiB buffer and of one whole layer's store
    (~1.2 GB; large copies run a few GB/s faster). A host memcpy on a CPU (dry run)."""
    if device.type == "cuda":
        target = torch.empty(store.nbytes, dtype=torch.uint8, device=device)
        layer_ms = cuda_time_ms(lambda: target.copy_(store.buffer, non_blocking=True), repeats=5, warmup=1)
        del target
        return pinned_copy_gbps(64 * 2**20), store.nbytes / layer_ms / 1e6
    target = torch.empty_like(store.buffer)
    start = time.perf_counter()
    target.copy_(store.buffer)
    gbps = store.nbytes / (time.perf_counter() - start) / 1e9
    return gbps, gbps


# -- variants ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Variant:
    """Providers for one way of serving the experts, and how to count its copies."""

    name: str
    cache: str  # "all", "stream" or the fraction of experts in slots, "25%"
    providers: list
    graph: bool
    bytes_per_step: int | None = None  # fixed copies (streaming); None: read the cache's stats
    num_slots: int | None = None  # slots one layer's call may use (caches: the pool's share)
    right: int | None = None  # prefetch: true ids among the K guesses an oracle makes per token
    lookahead: int = 2  # prefetch: how many layers on each router's guesses go (``DecodeStack``'s)
    across: bool = False  # prefetch: the hand-offs wrap into the next step (``DecodeStack``'s ``across_steps``)
    copies_only: bool = False  # the floor: the step without its expert compute (admissions and copies kept)
    overlap: bool = True  # False: the stack asks for passes one after the other (``--serial``)
    landing: bool = True  # False: the apply waits for a pass's whole copy, not each expert (``--unlanded``)
    landed_whole: bool = False  # True: gate_up waits for a whole expert's landing, not its w1 (``--landed-whole``)


def cached(
    bench: Bench, fraction: float, mode: str, shared: bool, coded: bool = False, mover: str | None = None
) -> Variant:
    E = bench.shape["experts"]
    stores = bench.coded_stores if coded else bench.stores
    assert stores is not None, "coded variants need the coded stores (build_bench)"
    slots = max(1, round(fraction * E))
    if shared:
        pool = SlotPool(stores[0].layout, slots * len(stores), device=bench.device, mode=mode, mover=mover)
        providers = [CachedWeightProvider(s, pool=pool, layer=index) for index, s in enumerate(stores)]
    else:
        providers = [
            CachedWeightProvider(s, pool=SlotPool(s.layout, slots, device=bench.device, mode=mode, mover=mover))
            for s in stores
        ]
    name = f"{mode}{' global' if shared else ''}{' coded' if coded else ''}{f' {mover} mover' if mover else ''}"
    graph = bench.graphs and mode == "device"
    return Variant(name, f"{fraction:.0%}", providers, graph, num_slots=providers[0].pool.share)


def copies_only(bench: Bench, fraction: float, shared: bool = False) -> Variant:
    variant = cached(bench, fraction, "device", shared)
    return dataclasses.replace(variant, name=f"{variant.name} copies only", copies_only=True)


def serial(bench: Bench, fraction: float) -> Variant:
    return dataclasses.replace(cached(bench, fraction, "device", False), name="device serial", overlap=False)


def unlanded(bench: Bench, fraction: float) -> Variant:
    return dataclasses.replace(cached(bench, fraction, "device", False), name="device unlanded", landing=False)


def landed_whole(bench: Bench, fraction: float) -> Variant:
    variant = cached(bench, fraction, "device", False)
    return dataclasses.replace(variant, name="device landed whole", landed_whole=True)


@contextlib.contextmanager
def counting_names_alike():
    """Landing counts in which no name counts apart (`landing.GATE_UP_NAMES` emptied while the
    variant's steps are built and run): gate_up waits for whole experts, as before the split."""
    names = landing.GATE_UP_NAMES
    landing.GATE_UP_NAMES = frozenset()
    try:
        yield
    finally:
        landing.GATE_UP_NAMES = names


def drain_passes(hidden: torch.Tensor, results, topk_weights: torch.Tensor) -> torch.Tensor:
    """An apply that computes nothing: it only runs the passes (admissions, copies, joins)."""
    for _ in results:
        pass
    return torch.zeros_like(hidden)


def prefetch_name(top_k: int, right: int, lookahead: int, across: bool = False) -> str:
    """``device prefetch R/K``, then ``ahead D`` past one layer (the rows before run 105 went
    one ahead), then ``across`` when the hand-offs wrap into the next step."""
    ahead = f" ahead {lookahead}" if lookahead > 1 or across else ""
    return f"device prefetch {right}/{top_k}{ahead}{' across' if across else ''}"


def prefetching(bench: Bench, fraction: float, right: int, lookahead: int, across: bool = False) -> Variant:
    variant = cached(bench, fraction, "device", False)
    name = prefetch_name(bench.shape["top_k"], right, lookahead, across)
    return dataclasses.replace(variant, name=name, right=right, lookahead=lookahead, across=across)


def oracle_guesses(routing: torch.Tensor, right: int, num_experts: int) -> torch.Tensor:
    """``[..., L, B, K]`` guesses: the first ``right`` true ids of each token, then wrong
    ones (true id + 37 mod E, which may by chance be right)."""
    return torch.cat([routing[..., :right], (routing[..., right:] + 37) % num_experts], dim=-1)


def step_guesses(variant: Variant, routing: torch.Tensor, num_experts: int) -> torch.Tensor | None:
    """The oracle's ``[N - 1, L, B, K]`` predictions for the first ``N - 1`` of ``routing``'s
    ``[N, L, B, K]`` steps (None without prefetches); across steps, rows ``0 .. D-1`` of step
    ``s`` are step ``s + 1``'s (``DecodeStack``'s ``across_steps``)."""
    if variant.right is None:
        return None
    guesses = oracle_guesses(routing, variant.right, num_experts)
    if not variant.across:
        return guesses[:-1]
    ahead = variant.lookahead
    return torch.cat([guesses[1:, :ahead], guesses[:-1, ahead:]], dim=1)


def streaming(bench: Bench, depth: int) -> Variant:
    ring = StreamingLayers(bench.stores, depth, device=bench.device)
    return Variant(f"stream d{depth}", "stream", ring.providers, bench.graphs, bytes_per_step=ring.bytes_per_step)


def variant_builders(
    bench: Bench,
    fractions: list[float],
    coded: list[float],
    prefetch: list[float],
    floor: list[float],
    serial_at: list[float],
    unlanded_at: list[float] = (),  # type: ignore[assignment]
    landed_whole_at: list[float] = (),  # type: ignore[assignment]
    lookaheads: list[int] = (2,),  # type: ignore[assignment]
    across: list[int] = (),  # type: ignore[assignment]
) -> list[tuple[str, Callable]]:
    """``(label, build)`` of every variant after the resident one, each built when it runs (memory)."""
    builders = [(f"stream d{d}", lambda d=d: streaming(bench, d)) for d in (1, 2) if d < len(bench.stores)]
    for fraction in fractions:
        for mode, shared in (("host", False), ("device", False), ("device", True)):
            label = f"{mode}{' global' if shared else ''} {fraction:.0%}"
            builders.append((label, lambda f=fraction, m=mode, s=shared: cached(bench, f, m, s)))
        if fraction in coded and bench.coded_stores:
            build = functools.partial(cached, bench, fraction, "device", False, True)
            builders.append((f"device coded {fraction:.0%}", build))
        for shared in (False, True) if fraction in floor else ():
            label = f"device{' global' if shared else ''} copies only {fraction:.0%}"
            builders.append((label, functools.partial(copies_only, bench, fraction, shared)))
        if fraction in serial_at:
            builders.append((f"device serial {fraction:.0%}", functools.partial(serial, bench, fraction)))
        if fraction in unlanded_at:
            builders.append((f"device unlanded {fraction:.0%}", functools.partial(unlanded, bench, fraction)))
        if fraction in landed_whole_at:
            label = f"device landed whole {fraction:.0%}"
            builders.append((label, functools.partial(landed_whole, bench, fraction)))
        if fraction in prefetch:
            for right in sorted({bench.shape["top_k"], 3 * bench.shape["top_k"] // 4}, reverse=True):
                for ahead in lookaheads:
                    label = f"{prefetch_name(bench.shape['top_k'], right, ahead)} {fraction:.0%}"
                    builders.append((label, functools.partial(prefetching, bench, fraction, right, ahead)))
            for ahead in across:  # the ceiling of any predictor: every guess right
                top_k = bench.shape["top_k"]
                label = f"{prefetch_name(top_k, top_k, ahead, True)} {fraction:.0%}"
                builders.append((label, functools.partial(prefetching, bench, fraction, top_k, ahead, True)))
    return builders


# -- measurement -------------------------------------------------------------------------------


def make_stack(bench: Bench, variant: Variant) -> DecodeStack:
    """The variant's decode stack; dense parts from one seed, so every variant computes alike."""
    options = {} if bench.apply is None else {"apply": bench.apply}
    overlap = bench.overlap and variant.overlap
    if variant.copies_only:  # the device rows' passes, computed by nothing
        options = {"apply": drain_passes, "overlap": overlap}
    elif not overlap:
        options["overlap"] = False
    if not variant.landing and not variant.copies_only:
        options["landing"] = False
    options["lookahead"] = variant.lookahead
    options["across_steps"] = variant.across
    shape = bench.shape
    return DecodeStack(variant.providers, shape["hidden"], shape["experts"], dtype=shape["dtype"], device=bench.device,
                       **options)  # fmt: skip


def total_stats(providers) -> CacheStats:
    return sum((p.stats for p in providers), CacheStats())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(run: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of ``run()``: CUDA events around it on a GPU, the wall clock on a CPU."""
    sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def holds_every_expert(variant: Variant) -> bool:
    """Whether each of the variant's pools has a slot for every expert of its layers (100%)."""
    pools = {id(p.pool): p.pool for p in variant.providers if hasattr(p, "pool")}
    return bool(pools) and all(
        pool.num_slots >= sum(p.num_experts for p in variant.providers if p.pool is pool) for pool in pools.values()
    )


def measure_batch(bench: Bench, variant: Variant, batch: int, *, warmup: int, steps: int) -> dict:
    """Warm up, then time ``steps`` steps of a batch of ``batch`` requests.

    A cache that holds every expert first steps over the whole trace (``ceil(N / B)``
    steps: each request runs through its share), so its timed steps are the steady state
    of a server, not the first touch of experts the warm-up never routed to.
    """
    shape, device = bench.shape, bench.device
    if bench.fill and holds_every_expert(variant):
        warmup += -(-bench.trace.shape[0] // batch)
    routing = torch.from_numpy(batch_routing(bench.trace, batch, warmup + steps + 1)).to(device)
    guesses = step_guesses(variant, routing, shape["experts"])  # the last step only feeds the guesses
    routing = routing[:-1]
    gen = torch.Generator(device=device).manual_seed(batch)
    hidden = torch.randn(warmup + steps, batch, shape["hidden"], device=device, generator=gen, dtype=shape["dtype"])
    stack = make_stack(bench, variant)
    extra = (lambda index: ()) if guesses is None else (lambda index: (guesses[index],))
    if variant.graph:
        step = GraphedDecodeStep(stack, hidden[0], routing[:1], None if guesses is None else guesses[:1])
    else:
        step = stack.step
    for index in range(warmup):
        step(hidden[index], routing[index], *extra(index))
    before = total_stats(variant.providers)
    prefetched_before = prefetched_bytes(variant.providers)

    def run() -> None:
        for index in range(warmup, warmup + steps):
            step(hidden[index], routing[index], *extra(index))

    ms = timed_ms(run, device) / steps
    delta = _stats_delta(total_stats(variant.providers), before)
    prefetched = (prefetched_bytes(variant.providers) - prefetched_before) / steps  # before the check step
    check = check_output(step, batch, shape, routing[0], device, *extra(0))
    copied = variant.bytes_per_step if variant.bytes_per_step is not None else delta.bytes_h2d / steps
    copied += prefetched  # the prefetches' copies cross PCIe too
    row = {
        "variant": variant.name, "cache": variant.cache, "batch": batch, "graph": variant.graph,
        "ms_per_step": ms, "tok_per_s": 1e3 * batch / ms, "mb_copied_per_step": copied / 1e6,
        "copy_ms": copied / (bench.copy_gbps * 1e6), "output": check,
    }  # fmt: skip
    if variant.bytes_per_step is None and variant.name != "resident":
        row.update(hit_rate=delta.hit_rate, overflows=delta.overflows,
                   max_passes=max_passes(batch * shape["top_k"], shape["experts"], variant.num_slots,
                                         overlap=bench.overlap and variant.overlap))  # fmt: skip
    if not variant.overlap:
        row["overlap"] = "off"
    if not variant.landing:
        row["landing"] = "off"
    if variant.landed_whole:
        row["landing"] = "whole"
    if variant.right is not None:
        row.update(right=variant.right, mb_prefetched_per_step=prefetched / 1e6)  # the name says how far ahead
    if "coded" in variant.name:  # PCIe carried the coded bytes
        coded = delta.compressed_bytes_h2d / steps
        row.update(mb_coded_per_step=coded / 1e6, coded_copy_ms=coded / (bench.copy_gbps * 1e6))
    return row


def check_output(step: Callable, batch: int, shape: dict, routing: torch.Tensor, device, *extra) -> torch.Tensor:
    """One more step on inputs every variant sees alike: its fp32 output, to compare."""
    gen = torch.Generator(device=device).manual_seed(10_000 + batch)
    hidden = torch.randn(batch, shape["hidden"], device=device, generator=gen, dtype=shape["dtype"])
    return step(hidden, routing, *extra).float().clone()


def prefetched_bytes(providers) -> int:
    """Bytes the providers' prefetches copied so far (0 for providers that cannot prefetch)."""
    return sum(p.prefetch_stats.bytes_h2d for p in providers if getattr(p, "mode", None) == "device")


def _stats_delta(after: CacheStats, before: CacheStats) -> CacheStats:
    return CacheStats(**{f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)})


def error_text(err: Exception) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0][:160]


@dataclasses.dataclass
class Reference:
    """The resident step at one batch size, which every variant is measured against."""

    ms: float  # ms per step
    output: torch.Tensor  # its check step's fp32 output
    dense_ms: float | None = None  # the same step without expert compute ("dense only")


def run_variant(bench: Bench, label: str, build: Callable[[], Variant], args, reference: dict) -> list[dict]:
    """One variant at every batch size; a failure is a row with its error, not the end.

    ``reference`` maps batch size -> `Reference`: the resident variant fills it, the dense-only
    one adds its time, every later one is measured against it.
    """
    start = time.perf_counter()
    try:
        variant = build()
    except Exception as err:  # report it and go on with the next variant
        return [{"variant": label, "error": error_text(err)}]
    rows = []
    for batch in args.batch_sizes:
        if variant.right is not None and batch * bench.shape["top_k"] > variant.num_slots:
            continue  # a prefetch holds at most the slots' worth of ids
        warmup, steps = (1, args.streaming_steps) if variant.cache == "stream" else (args.warmup, args.steps)
        try:
            with counting_names_alike() if variant.landed_whole else contextlib.nullcontext():
                row = measure_batch(bench, variant, batch, warmup=warmup, steps=steps)
        except Exception as err:  # the tree under test may not serve this size yet
            sync(bench.device)
            row = {"variant": variant.name, "cache": variant.cache, "batch": batch, "error": error_text(err)}
        output = row.pop("output", None)
        if variant.name == "resident" and output is not None:
            reference[batch] = Reference(row["ms_per_step"], output)
        elif variant.name == DENSE_ONLY and batch in reference and "error" not in row:
            reference[batch].dense_ms = row["ms_per_step"]
        rows.append(finish_row(row, output, reference.get(batch)))
        if variant.copies_only:  # it computes no experts: its output is not the model's
            for key in ("max_abs_err", "rel_err"):
                rows[-1].pop(key, None)
        gc.collect()
    if args.profile and variant.cache != "stream":
        profile_decode(bench, variant, args.batch_sizes[0], args)
    print(f"  {label}: {time.perf_counter() - start:.1f} s", flush=True)
    del variant
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def finish_row(row: dict, output: torch.Tensor | None, resident: Reference | None) -> dict:
    """Bounds, ratios, and the last output's distance from the resident step's (same inputs)."""
    coded_ms = row.pop("coded_copy_ms", None)
    if resident is None or output is None:
        return row
    resident_ms, reference = resident.ms, resident.output
    row["bound_ms"] = max(resident_ms, row["copy_ms"])
    row["ratio_to_bound"] = row["ms_per_step"] / row["bound_ms"]
    row["serial_bound_ms"] = resident_ms + row["copy_ms"]  # nothing overlapped
    row["ratio_to_serial"] = row["ms_per_step"] / row["serial_bound_ms"]
    if resident.dense_ms is not None:  # the copies wait for the dense parts and routers, and they for the copies
        row["causal_bound_ms"] = max(resident_ms, resident.dense_ms + row["copy_ms"])
        row["ratio_to_causal"] = row["ms_per_step"] / row["causal_bound_ms"]
    if coded_ms is not None:  # against the bound of the bytes it actually moved
        row["ratio_to_coded"] = row["ms_per_step"] / max(resident_ms, coded_ms)
    row["max_abs_err"] = (output - reference).abs().max().item()
    row["rel_err"] = row["max_abs_err"] / max(reference.abs().max().item(), 1e-30)
    return row


# -- the two modes ---------------------------------------------------------------------------------

DECODE_COLUMNS = [
    "variant", "cache", "batch", "graph", "ms_per_step", "tok_per_s", "hit_rate", "max_passes",
    "mb_copied_per_step", "mb_prefetched_per_step", "mb_coded_per_step", "copy_ms", "bound_ms", "ratio_to_bound",
    "ratio_to_serial", "ratio_to_causal", "ratio_to_coded", "overflows", "rel_err", "error",
]  # fmt: skip
#: the resident step without expert compute: the causal bound's part no cache overlaps with copies
DENSE_ONLY = "dense only"
#: measurements that no user can serve with: left out of the plot
NOT_SERVABLE = ("copies only", "prefetch", DENSE_ONLY)


def run_decode(bench: Bench, args, resident: list[dict], save: Callable[[list[dict]], object]) -> list[dict]:
    """Every variant at every batch size, the resident one first (the others' bound and check);
    each variant's rows are handed to ``save`` as soon as they are measured (a run cut short
    keeps what it measured)."""
    reference: dict[int, Reference] = {}
    providers = [FullGPUProvider(w) for w in resident]
    resident.clear()  # the resident weights leave the GPU with their providers, before the caches come in
    rows = run_variant(bench, "resident", lambda: Variant("resident", "all", providers, bench.graphs, 0), args,
                       reference)  # fmt: skip
    save(rows)
    dense = functools.partial(Variant, DENSE_ONLY, "all", providers, bench.graphs, 0, copies_only=True)
    rows += (new := run_variant(bench, DENSE_ONLY, dense, args, reference))
    save(new)
    providers.clear()
    builders = variant_builders(bench, args.fractions, args.coded, args.prefetch, args.floor, args.serial,
                                args.unlanded, args.landed_whole, args.lookahead, args.across)  # fmt: skip
    if args.only:
        builders = [(label, build) for label, build in builders if any(part in label for part in args.only)]
        if not builders:
            print(
                f"bench_batch: error: --only {' '.join(args.only)} names none of this run's variants", file=sys.stderr
            )
            sys.exit(2)
        print(f"--only {' '.join(args.only)}: {', '.join(label for label, _ in builders)} (and resident)")
    for label, build in builders:
        rows += (new := run_variant(bench, label, build, args, reference))
        save(new)
    return rows


def run_prefill(bench: Bench, args, resident: list[dict]) -> list[dict]:
    """One forward over T tokens per variant: resident, streaming, host and device caches (cold)."""
    rows = []
    for tokens in args.prefill:
        routing = torch.from_numpy(prefill_routing(bench.trace, tokens)).to(bench.device)
        hidden = torch.randn(tokens, bench.shape["hidden"], device=bench.device, dtype=bench.shape["dtype"])
        touched = sum(len(np.unique(layer)) for layer in routing.cpu().numpy()) * bench.expert_bytes
        builders = {
            "resident": lambda: Variant("resident", "all", [FullGPUProvider(w) for w in resident], False, 0),
            **{f"stream d{d}": (lambda d=d: streaming(bench, d)) for d in (1, 2) if d < len(bench.stores)},
            "host": lambda: cached(bench, args.prefill_fraction, "host", False),
            "device": lambda: cached(bench, args.prefill_fraction, "device", False),
            "device kernel mover": lambda: cached(bench, args.prefill_fraction, "device", False, mover="kernel"),
            **({"device coded": lambda: cached(bench, args.prefill_fraction, "device", False, True)}
               if bench.coded_stores else {}),
        }  # fmt: skip
        resident_ms = None
        for name, build in builders.items():
            row = {"variant": name, "tokens": tokens, "mb_touched": touched / 1e6}
            try:
                row |= prefill_once(bench, build, hidden, routing, args.prefill_repeats)
            except Exception as err:  # the tree under test may not serve this size yet
                sync(bench.device)
                row["error"] = error_text(err)
            if name == "resident":
                resident_ms = row.get("ms")
            if resident_ms is not None and "ms" in row:  # the resident forward copies nothing
                row["bound_ms"] = resident_ms + (0 if name == "resident" else touched / (bench.copy_gbps * 1e6))
                row["ratio_to_bound"] = row["ms"] / row["bound_ms"]
            rows.append(row)
            if args.profile and name not in ("resident",) and "error" not in row:
                profile_prefill(bench, build, hidden, routing, f"{name}, {tokens} tokens")
            gc.collect()
            if bench.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def profile_prefill(bench: Bench, build: Callable[[], Variant], hidden, routing, title: str) -> None:
    """One more cold forward under `torch.profiler`: its GPU time by kernel, and the idle share."""
    from torch.profiler import ProfilerActivity, profile

    variant = build()
    stack = make_stack(bench, variant)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.device.type == "cuda" else [])
    sync(bench.device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        stack.step(hidden, routing)
        sync(bench.device)
    wall_ms = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()
    busy_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    print(f"\nprofile: {title}: {wall_ms:.1f} ms wall (profiled), GPU busy {busy_us / 1e3:.1f} ms "
          f"(kernels and copies; they may overlap)")  # fmt: skip
    print(events.table(sort_by="self_device_time_total" if bench.device.type == "cuda" else "self_cpu_time_total",
                       row_limit=14, max_name_column_width=60))  # fmt: skip
    del stack, variant


def profile_decode(bench: Bench, variant: Variant, batch: int, args) -> None:
    """A few graph replays of one warm decode step under `torch.profiler`: per step, the time
    the copy kernel runs alone, compute runs alone, both run, and the GPU sits idle, the
    kernels by total time, and the gaps between copies by what ran in them
    (`profile_timeline.report`); the Chrome trace's path (one per variant)."""
    from torch.profiler import ProfilerActivity, profile

    if bench.device.type != "cuda":
        print("profile: decode profiles need a GPU (the profiler sees CUDA kernels)")
        return
    replays = 4
    routing = torch.from_numpy(batch_routing(bench.trace, batch, args.warmup + replays + 1)).to(bench.device)
    guesses = step_guesses(variant, routing, bench.shape["experts"])
    routing = routing[:-1]
    hidden = torch.randn(batch, bench.shape["hidden"], device=bench.device, dtype=bench.shape["dtype"])
    stack = make_stack(bench, variant)
    extra = (lambda index: ()) if guesses is None else (lambda index: (guesses[index],))
    if variant.graph:
        step = GraphedDecodeStep(stack, hidden, routing[:1], None if guesses is None else guesses[:1])
    else:
        step = stack.step
    for index in range(args.warmup):
        step(hidden, routing[index], *extra(index))
    sync(bench.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for index in range(args.warmup, args.warmup + replays):
            step(hidden, routing[index], *extra(index))
        sync(bench.device)
    folder = Path(args.profile_dir) if args.profile_dir else Path(tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    name = f"trace_{variant.name}_{variant.cache}_B{batch}".replace(" ", "_").replace("/", "of").replace("%", "pct")
    path = folder / f"{name}.json"
    prof.export_chrome_trace(str(path))
    try:
        events = load_events(path)
    except ValueError as err:
        print(f"profile {variant.name} {variant.cache} B={batch}: {err}")
        return
    print(f"\nprofile {variant.name} {variant.cache} B={batch} (profiled): {report(events, replays)}")
    print(f"  trace: {path} (python benchmarks/profile_timeline.py {path})")
    del step, stack


def prefill_once(bench: Bench, build: Callable[[], Variant], hidden, routing, repeats: int) -> dict:
    """Median ms of one forward, each on freshly built (cold) providers after one warm forward."""
    times, copied = [], []
    for repeat in range(repeats + 1):
        variant = build()
        stack = make_stack(bench, variant)
        ms = timed_ms(lambda stack=stack: stack.step(hidden, routing), bench.device)
        if repeat:  # the first forward compiles
            times.append(ms)
            fixed = variant.bytes_per_step
            copied.append(fixed if fixed is not None else total_stats(variant.providers).bytes_h2d)
        del stack, variant
    return {"ms": float(np.median(times)), "mb_copied": float(np.median(copied)) / 1e6}


# -- output ------------------------------------------------------------------------------------------


def plot(rows: list[dict], fractions: list[float], path: Path, title: str) -> Path | None:
    """tokens/s against batch size, one panel per cache fraction, one line per variant a user
    can run (the floor, the oracle prefetches and the dense-only step are measurements, not
    ways to serve)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    width = max(7.5, 5 * len(fractions) + 1.5)
    fig, axes = plt.subplots(1, len(fractions), figsize=(width, 4.5), sharey=True, squeeze=False)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors: dict[str, str] = {}  # one color per variant in every panel, so the one legend holds
    for axis, fraction in zip(axes[0], fractions, strict=True):
        cache = f"{fraction:.0%}"
        lines: dict[str, list] = {}
        for row in rows:
            servable = not any(part in row["variant"] for part in NOT_SERVABLE)
            if "tok_per_s" in row and row["cache"] in ("all", "stream", cache) and servable:
                lines.setdefault(row["variant"], []).append((row["batch"], row["tok_per_s"]))
        for name, points in lines.items():
            color = colors.setdefault(name, palette[len(colors) % len(palette)])
            axis.plot(*zip(*sorted(points), strict=True), marker="o", label=name, color=color)
        axis.set(xscale="log", yscale="log", title=f"{cache} of experts in slots", xlabel="batch size")
        axis.set_xscale("log", base=2)
        axis.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("tokens / s")
    legend = {}  # every variant once, whichever panel drew it
    for axis in axes[0]:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), fontsize=8, loc="center right")  # beside the panels, over no line
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--layers", type=int, default=None, help="default 12 (3 in a dry run)")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per variant and batch size")
    parser.add_argument("--warmup", type=int, default=24, help="untimed steps first (cache warm-up)")
    parser.add_argument("--streaming-steps", type=int, default=3, help="timed steps of streaming (~0.3 s each)")
    parser.add_argument("--apply", choices=("auto", "gemv", "default"), default="default",
                        help="auto: moe_apply_auto if present; default: DecodeStack's own")  # fmt: skip
    parser.add_argument("--prefill", type=int, nargs="+", default=None, metavar="T", help="prefill mode: T tokens")
    parser.add_argument("--prefill-fraction", type=float, default=0.25)
    parser.add_argument("--prefill-repeats", type=int, default=2)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one more forward (prefill) or a few replays at the first batch size (decode)",
    )
    parser.add_argument("--profile-dir", default=None, metavar="DIR",
                        help="with --profile: keep the decode profiles' Chrome traces here (default: a "
                             "temporary folder)")  # fmt: skip
    parser.add_argument("--prefetch", type=float, nargs="*", default=[0.25, 0.5], metavar="FRACTION",
                        help="device mode with oracle prefetches at these fractions (none given: none)")  # fmt: skip
    parser.add_argument("--lookahead", type=int, nargs="+", default=[2], metavar="D",
                        help="the oracle prefetches go this many layers ahead: each router starts layer l + D's "
                             "(one row per D; default 2, DecodeStack's)")  # fmt: skip
    parser.add_argument("--across", type=int, nargs="+", default=[], metavar="D",
                        help="also oracle prefetches whose hand-offs wrap into the next step, D layers ahead "
                             "(one row per D, every guess right, at the --prefetch fractions): the last D routers "
                             "start the next token's first D layers")  # fmt: skip
    parser.add_argument("--coded", type=float, nargs="*", default=[0.25, 0.5], metavar="FRACTION",
                        help="device mode over exponent-coded stores at these fractions (prefill: any adds it; "
                             "none given: no coded variant)")  # fmt: skip
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="decode: only the variants whose label contains one of these (e.g. 'global' "
                             "'device 25%%'), besides the resident one")  # fmt: skip
    parser.add_argument("--floor", type=float, nargs="*", default=[0.25, 0.5], metavar="FRACTION",
                        help="device mode without expert compute (admissions, copies, dense parts), per-layer "
                             "and global pools, at these fractions: the floor of any apply (none: none)")  # fmt: skip
    parser.add_argument("--serial", type=float, nargs="*", default=[], metavar="FRACTION",
                        help="device mode at these fractions with passes one after the other (no overlap), beside "
                             "the overlapped rows: the overlap's gain in one process")  # fmt: skip
    parser.add_argument("--unlanded", type=float, nargs="*", default=[], metavar="FRACTION",
                        help="device mode at these fractions whose apply waits for each pass's whole copy (no "
                             "landing counts), beside the device rows: the landing counts' gain in one "
                             "process")  # fmt: skip
    parser.add_argument("--landed-whole", type=float, nargs="*", default=[], metavar="FRACTION",
                        help="device mode at these fractions whose landing counts count every name alike (gate_up "
                             "waits for whole experts, not their w1), beside the device rows: the split counts' "
                             "gain in one process")  # fmt: skip
    parser.add_argument(
        "--overlap",
        choices=("on", "off"),
        default="on",
        help="off: device caches serve a decode call in passes of the whole share, one after the other "
        "(no hits-then-misses split, no overlapped passes)",
    )
    parser.add_argument(
        "--chain",
        choices=("on", "off"),
        default="on",
        help="off: no programmatic dependent launch between the decode kernels",
    )
    parser.add_argument(
        "--copy-priority",
        choices=("high", "default"),
        default="high",
        help="default: device pools' copy streams at the default priority, not above the apply's (an ablation)",
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, interpreted kernels")
    parser.add_argument(
        "--replot",
        nargs="+",
        metavar="COMMIT",
        help="no measurement: draw bench_batch.png from results/bench_batch.csv's rows of these commits at the "
        "default --overlap/--chain/--copy-priority (the newest row of each variant, cache and batch size) at "
        "--fractions",
    )
    args = parser.parse_args()
    defaults = vars(parser.parse_args([]))  # a flag given at its default value changes nothing either
    changed = {name for name, value in vars(args).items() if value != defaults[name]}
    if args.replot and changed - {"replot", "fractions"}:
        parser.error("--replot draws the CSV's rows: it takes only --fractions")
    if args.profile_dir and (not args.profile or args.prefill):
        parser.error("--profile-dir keeps the decode profiles' traces: it needs --profile, in decode mode")
    if args.only and args.prefill:
        parser.error("--only picks decode variants; a prefill run has its own fixed set")

    if args.prefill and args.prefetch != parser.get_default("prefetch"):
        parser.error("--prefetch runs in decode mode only (a prefill forward has no next token to guess for)")
    if min(args.lookahead) < 1:
        parser.error(f"--lookahead takes layers ahead of at least 1, got {min(args.lookahead)}")
    if args.lookahead != parser.get_default("lookahead") and (args.prefill or not args.prefetch):
        parser.error("--lookahead sets how far the oracle prefetches go: it needs --prefetch, in decode mode")
    if args.across and (args.prefill or not args.prefetch):
        parser.error("--across adds oracle prefetches across steps: it needs --prefetch, in decode mode")
    layers = args.layers or (TINY if args.dry_run else QWEN3)["layers"]
    if args.across and not 1 <= min(args.across) <= max(args.across) < layers:
        parser.error(f"--across takes layers ahead in 1..{layers - 1} (fewer than the {layers} layers), got "
                     f"{' '.join(map(str, args.across))}")  # fmt: skip
    if not args.prefill:  # a decode run serves these only at its own fractions
        for flag in ("coded", "prefetch", "floor", "serial", "unlanded", "landed_whole"):
            extra = sorted(set(getattr(args, flag)) - set(args.fractions))
            if extra and getattr(args, flag) != parser.get_default(flag):
                parser.error(
                    f"--{flag.replace('_', '-')} {' '.join(map(str, extra))} is not among --fractions {args.fractions}"
                )
    if args.dry_run and args.batch_sizes == parser.get_default("batch_sizes"):
        args.batch_sizes = [1, 16]  # 16: several passes at 25%, and the grouped apply
    if args.dry_run:
        args.steps, args.warmup, args.streaming_steps = min(args.steps, 2), min(args.warmup, 1), 1
    return args


def build_bench(args) -> tuple[Bench, list[dict]]:
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench_batch needs a CUDA GPU (use --dry-run to check the plumbing on a CPU)")
    shape = dict(TINY if args.dry_run else QWEN3)
    shape["layers"] = args.layers or shape["layers"]
    device = torch.device("cpu" if args.dry_run else "cuda")
    trace = qwen3_routing(traces_dir() / QWEN3_TRACE, shape["layers"])
    gen = torch.Generator(device=device).manual_seed(0)
    start = time.perf_counter()
    resident = [layer_weights(shape, device, gen) for _ in range(shape["layers"])]
    _, layout = layout_from_weights(resident[0])
    stores = [CPUBackingStore(layout, w, pin=device.type == "cuda") for w in resident]
    apply, apply_name = resolve_apply(args.apply)
    small_gbps, layer_gbps = copy_bandwidth_gbps(stores[0], device)
    bench = Bench(shape, device, stores, trace, apply, max(small_gbps, layer_gbps), graphs=device.type == "cuda",
                  fill=not args.dry_run, overlap=args.overlap == "on")  # fmt: skip
    _launch.PROGRAMMATIC_LAUNCH = args.chain == "on"
    if args.copy_priority == "default":
        slot_pool.COPY_STREAM_PRIORITY = 0
    shape.update(apply=apply_name, pinned_gbps_64mib=small_gbps, pinned_gbps_layer=layer_gbps)
    print(f"{shape['name']}: {shape['layers']} layers x {shape['experts']} experts, "
          f"{bench.expert_bytes / 1e6:.2f} MB per expert, {trace.shape[0]} trace tokens, apply {apply_name}; "
          f"{sum(s.nbytes for s in stores) / 1e9:.2f} GB built and pinned in {time.perf_counter() - start:.1f} s; "
          f"pinned copy bandwidth {small_gbps:.1f} GB/s (64 MiB), {layer_gbps:.1f} GB/s (one layer, "
          f"{stores[0].nbytes / 1e9:.2f} GB)", flush=True)  # fmt: skip
    if args.coded and shape["dtype"] in (torch.bfloat16, torch.float16):
        start = time.perf_counter()  # encoded where the weights are (the GPU)
        bench.coded_stores = [
            CPUBackingStore(layout, w, pin=device.type == "cuda", compression="exponent", progress=False)
            for w in resident
        ]
        print(f"coded stores: {sum(s.nbytes for s in bench.coded_stores) / 1e9:.2f} GB, encoded and pinned in "
              f"{time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    elif args.coded:
        print(f"no coded variants: the exponent code takes bf16/fp16 experts, these are {shape['dtype']}")
    return bench, resident


#: The settings (--overlap, --chain, --copy-priority, landing counts) whose rows `replot` draws: the
#: defaults, not ablations (``--unlanded`` rows say ``landing`` off, ``--landed-whole`` ones whole).
PLOTTED = ("on", "on", "high", "on")


def replot_rows(commits: list[str]) -> list[dict]:
    """The CSV's decode rows of ``commits`` run at the default settings (not an ablation's):
    the newest row of each variant, cache and batch size, ``batch`` and ``tok_per_s`` as
    numbers. Exits with status 2 and one line when there is no CSV or no such row."""
    import csv

    path = _common.RESULTS / "bench_batch.csv"
    if not path.is_file():
        print(f"bench_batch: error: no {path} to replot", file=sys.stderr)
        sys.exit(2)
    newest: dict[tuple, dict] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            ablation = (row.get("overlap") or "on", row.get("chain") or "on", row.get("copy_priority") or "high",
                        row.get("landing") or "on")  # fmt: skip
            if row["commit"] in commits and row.get("tok_per_s") and not row.get("error") and ablation == PLOTTED:
                newest[(row["variant"], row["cache"], int(row["batch"]))] = row
    if not newest:
        print(f"bench_batch: error: {path} has no decode rows of commit {' '.join(commits)}", file=sys.stderr)
        sys.exit(2)
    return [{**row, "batch": batch, "tok_per_s": float(row["tok_per_s"])} for (_, _, batch), row in newest.items()]


def replot(commits: list[str], fractions: list[float]) -> Path | None:
    """`plot` of `replot_rows` into results/bench_batch.png."""
    rows = replot_rows(commits)
    first = rows[0]
    title = (f"{first['shape']} decode, {first['layers']} layers\n{first['apply']}, {first['gpu']} "
             f"(commits {', '.join(commits)})")  # fmt: skip
    return plot(rows, fractions, _common.RESULTS / "bench_batch.png", title)


def main() -> None:
    args = parse_args()
    if args.replot:
        print(f"plot: {replot(args.replot, args.fractions)}")
        return
    if args.dry_run:  # nothing of a CPU check lands among the results
        _common.RESULTS = Path(tempfile.mkdtemp(prefix="bench_batch_dry_"))
    start = time.perf_counter()
    bench, resident = build_bench(args)
    shape = bench.shape
    stamp = {"overlap": args.overlap, "chain": args.chain, "copy_priority": args.copy_priority,
             "shape": shape["name"], "layers": shape["layers"], "dtype": str(shape["dtype"]).removeprefix("torch."),
             "apply": shape["apply"], "pinned_gbps": bench.copy_gbps, "pinned_gbps_64mib": shape["pinned_gbps_64mib"],
             "pinned_gbps_layer": shape["pinned_gbps_layer"]}  # fmt: skip
    if args.prefill:
        rows = run_prefill(bench, args, resident)
        columns = ["variant", "tokens", "ms", "mb_touched", "mb_copied", "bound_ms", "ratio_to_bound", "error"]
        print_table(rows, columns, title=f"{shape['name']} prefill, {shape['layers']} layers, "
                                         f"{args.prefill_fraction:.0%} cache (cold), eager")  # fmt: skip
        print(f"CSV: {append_csv('bench_batch_prefill', [{**stamp, **r} for r in rows])}")
    else:
        rows = run_decode(bench, args, resident, lambda new: append_csv("bench_batch", [{**stamp, **r} for r in new]))
        title = (f"{shape['name']} decode, {shape['layers']} layers; bound = max(resident step, copied bytes / "
                 f"{bench.copy_gbps:.1f} GB/s); serial: resident + copies; causal: max(resident, dense only + "
                 "copies)")  # fmt: skip
        print_table(rows, DECODE_COLUMNS, title=title)
        print(f"CSV: {_common.RESULTS / 'bench_batch.csv'}")
        title = f"{shape['name']} decode, {shape['layers']} layers\n{shape['apply']}, {_common.environment()['gpu']}"
        print(f"plot: {plot(rows, args.fractions, _common.RESULTS / 'bench_batch.png', title)}")
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
