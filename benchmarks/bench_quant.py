"""Quantised experts through the graphed decode stack: GPT-OSS-20B MXFP4 vs bf16 at equal GPU bytes.

**GPT-OSS-20B** expert shapes: 24 layers x 32 experts, top-4, H = I = 2880, in two formats of
one model (random weights, quantised on the GPU, then copied into pinned stores)::

    mxfp4  GPT-OSS's layout: e2m1 blocks + e8m0 scales + fp32 biases, interleaved gate/up,
           clamped SwiGLU (`expertcache.quant.GPT_OSS_MXFP4`), 13.25 MB per expert;
           apply `moe_apply_quant_passes(scheme=GPT_OSS_MXFP4)`
    bf16   the same experts dequantised (exact in bf16) + the same fp32 biases, 49.8 MB per
           expert (3.76x); apply `moe_apply_quant_passes(scheme=GPT_OSS_BF16)`: the same
           kernels and MLP (interleaved gate/up, clamped SwiGLU, biases) on unquantised weights
           (format "none"), so the two formats differ only in the bytes they read and decode.
           The all-resident bf16 step also runs GPT-OSS's MLP in torch (`gpt_oss_apply_torch`,
           gathers the weights: ~3x the bytes), an independent check of the same function.

Every variant is a device-mode `CachedWeightProvider` per layer over those pinned stores (the
cache inside the graph), the whole step one CUDA graph (`GraphedDecodeStep`), batch 1. Budgets,
as MXFP4 slots; the bf16 model gets the same GPU bytes (``floor(slots * 13.25 / 49.8)``, ~3.8x
fewer slots, several passes where a layer's 4 experts exceed its slots)::

    238 slots in one global pool (the vLLM expert-cache RFC's budget; scaled by layers / 24)
    25% / 50% / 100% of the experts: per-layer pools (8 / 16 / 32 slots), and one global pool
        of the same total (192 / 384 / 768)
    all resident (FullGPUProvider): MXFP4 10.2 GB, bf16 38.3 GB

Routing (no GPT-OSS trace exists):
  * ``trace``: the real Qwen3-30B-A3B trace (128 experts, top-8, 297 tokens; trace layer l =
    layer l), mapped to 32 experts and top-4: the trace's ids in router order, each mod 32,
    then ``(first id + 1, + 2, ...) mod 32`` (fillers, only when needed); the first 4
    distinct values. Token t of the run is trace token ``t mod 297``.
  * ``uniform``: 4 distinct experts per layer uniformly at random (seeded): the worst case of
    an LRU cache (no reuse beyond chance).

**DeepSeek-V3** fp8 shape point: 4 layers, H = 7168, I = 2048, 256 experts, top-8, e4m3 with
128x128 block scales (44 MB per expert, `FP8_BLOCK_128`); layer l's top-8 = the first 4 ids of
trace layers 2l and 2l+1 (+128), as `bench_decode.py --shape deepseek-v3`. Per-layer pools at
25/50/100% and all resident, each with the old apply (`moe_apply_passes`, block-scaled fp8 in
`moe_apply`'s kernel, what bench_decode runs) and the new `moe_apply_quant_passes
(scheme=FP8_BLOCK_128)` side by side, on the same stores and slots.

Per row: bytes copied per token (``bytes_h2d`` delta), hit rate, ms per step, tok/s, and the
bound, the resident graphed step of the same format and apply (R) plus the copies at the
measured pinned copy-engine bandwidth (B, the faster of a 64 MiB copy and one layer's store)::

    serial bound = R + copied bytes / B      (a layer's misses are known only after its router)
    max bound    = max(R, copied bytes / B)  (copies hidden under compute)

and the step time over each. ``rel_err``: a check step's output (same inputs for every
variant) against its own resident step's (0 = bit-identical), and for the resident rows of
other formats or applies against the section's first resident row (mxfp4 vs bf16, in the
kernels and in the torch MLP; fp8 old vs new apply). Anchor: tinyserve reports ~30 tok/s for GPT-OSS-20B MXFP4 on
an 8 GB laptop GPU; that is other hardware (PCIe, GPU): compare MB per token and the ratio to
the bound, not tok/s.

Timing: ``--warmup`` graph steps (cache warm-up), then ``--steps`` timed with CUDA events.
Rows are appended to ``results/bench_quant.csv`` as they come (stamped with GPU, versions,
commit). ``--dry-run``: tiny shapes (E and top-k kept), fp32 activations and fp16 for the
16-bit format on the CPU, kernels interpreted, eager (no graphs), results to a temporary
folder: a check of the plumbing, not a measurement.

Cost on an H200 (estimated from the trace's hit rates, not yet run): 48.5 GB pinned for
GPT-OSS (both formats, ~20-30 s to build) and 45 GB for DeepSeek (built after GPT-OSS's are
freed, 15-50 s); 48.5 GB and then 90 GB of GPU memory at most; ~2 min of GPT-OSS steps (the
bf16 rows copy 2-4.8 GB a step), ~4 min in all.

    python benchmarks/bench_quant.py [--sections gpt-oss deepseek] [--routings trace uniform]
                                     [--fractions 0.25 0.5 1.0] [--warmup 32] [--steps 48]
    python benchmarks/bench_quant.py --dry-run            (~30 s on a CPU)
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import append_csv, print_table, traces_dir  # noqa: E402
from bench_batch import copy_bandwidth_gbps, error_text, sync, timed_ms  # noqa: E402
from bench_decode import QWEN3_TRACE, qwen3_routing, shape_routing  # noqa: E402

from expertcache import CachedWeightProvider, CacheStats, FullGPUProvider, SlotPool  # noqa: E402
from expertcache.decode_stack import DecodeStack, GraphedDecodeStep  # noqa: E402
from expertcache.kernels import moe_apply_passes, moe_apply_quant_passes  # noqa: E402
from expertcache.layout import layout_from_weights  # noqa: E402
from expertcache.passes import max_passes  # noqa: E402
from expertcache.quant import FP8_BLOCK_128, GPT_OSS_BF16, GPT_OSS_MXFP4  # noqa: E402
from expertcache.quant_tensors import dequantize_experts, quantize_experts  # noqa: E402
from expertcache.result import ExpertWeightResult  # noqa: E402
from expertcache.store import CPUBackingStore  # noqa: E402

GPT_OSS_20B = dict(name="GPT-OSS-20B", hidden=2880, inter=2880, experts=32, top_k=4, layers=24)
DEEPSEEK_V3 = dict(name="DeepSeek-V3 fp8", hidden=7168, inter=2048, experts=256, top_k=8, layers=4)
# dry run: the routing shapes (E, top-k) kept, tiny matrices (one MXFP4 group, 2 x 1 and 1 x 1 fp8 blocks)
TINY_GPT_OSS = dict(name="GPT-OSS-like (dry run)", hidden=32, inter=32, experts=32, top_k=4, layers=2)
TINY_DEEPSEEK = dict(name="DeepSeek-like (dry run)", hidden=128, inter=64, experts=256, top_k=8, layers=1)
RFC_SLOTS, RFC_LAYERS = 238, 24  # the vLLM RFC's budget: 238 slots for GPT-OSS-20B's 24 layers
ANCHOR = ("anchor: tinyserve ~30 tok/s for GPT-OSS-20B MXFP4 on an 8 GB laptop GPU (other hardware: "
          "compare MB per token and ratio to bound, not tok/s)")  # fmt: skip
CHUNK = 8  # experts quantised at a time (bounds the fp32 temporaries on the GPU)


@dataclasses.dataclass
class Family:
    """One format of a model's experts and the apply that reads it (every apply computes the
    model's MLP, so resident outputs of one model compare across formats and applies)."""

    name: str  # "mxfp4", "bfloat16", ...
    apply_name: str
    apply: Callable
    stores: list[CPUBackingStore]
    resident: list[dict[str, torch.Tensor]]  # the same experts on the device

    @property
    def expert_bytes(self) -> int:
        return self.stores[0].layout.expert_bytes


@dataclasses.dataclass
class Section:
    """What every variant of one model shares: shape, inputs, dense parts, bandwidth."""

    shape: dict
    device: torch.device
    template: DecodeStack  # dense parts drawn once (same seed: every variant computes alike)
    hidden: torch.Tensor  # [N, 1, H] per-step activations
    check_hidden: torch.Tensor  # [1, H] the check step's input
    copy_gbps: float
    graphs: bool
    warmup: int
    steps: int


# -- routing ---------------------------------------------------------------------------------------


def fold_routing(trace: np.ndarray, num_experts: int, top_k: int) -> np.ndarray:
    """``[N, L, top_k]`` from ``[N, L, K']`` ids: ids mod ``num_experts`` in order, then fillers
    ``(first + 1, first + 2, ...) mod num_experts``; the first ``top_k`` distinct values."""
    folded = trace % num_experts
    fillers = (folded[..., :1] + np.arange(1, num_experts)) % num_experts
    candidates = np.concatenate([folded, fillers], axis=-1).reshape(-1, folded.shape[-1] + num_experts - 1)
    out = np.empty((candidates.shape[0], top_k), dtype=np.int64)
    for row, ids in enumerate(candidates):
        out[row] = list(dict.fromkeys(ids.tolist()))[:top_k]
    return out.reshape(*trace.shape[:-1], top_k)


def uniform_routing(tokens: int, layers: int, num_experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """``[tokens, layers, top_k]`` distinct experts uniformly at random."""
    scores = np.random.default_rng(seed).random((tokens, layers, num_experts))
    return np.argsort(scores, axis=-1)[..., :top_k].astype(np.int64)


def routings(shape: dict, names: list[str], tokens: int, deepseek: bool) -> dict[str, np.ndarray]:
    """``{name: [tokens, L, K]}``; the trace rows cycle (token t = trace token t mod N)."""
    L, E, K = shape["layers"], shape["experts"], shape["top_k"]
    out = {}
    for name in names:
        if name == "uniform":
            out[name] = uniform_routing(tokens, L, E, K)
            continue
        try:
            trace = shape_routing("deepseek-v3", L) if deepseek else qwen3_routing(traces_dir() / QWEN3_TRACE, L)
        except FileNotFoundError as err:
            print(f"no trace routing ({err}): skipped")
            continue
        folded = trace if deepseek else fold_routing(trace, E, K)
        out[name] = folded[np.arange(tokens) % folded.shape[0]]
    return out


# -- weights ----------------------------------------------------------------------------------------


def gpt_oss_layer(shape: dict, device, gen, dense_dtype) -> tuple[dict, dict]:
    """One layer's random experts as MXFP4 tensors and as their exact 16-bit dequantisation."""
    E, H, inter = shape["experts"], shape["hidden"], shape["inter"]
    mxfp4: dict[str, list] = {}
    dense: dict[str, list] = {}
    for start in range(0, E, CHUNK):
        count = min(CHUNK, E - start)
        w1 = torch.randn(count, 2 * inter, H, device=device, generator=gen) * H**-0.5
        w2 = torch.randn(count, H, inter, device=device, generator=gen) * inter**-0.5
        b1 = torch.randn(count, 2 * inter, device=device, generator=gen) * 0.1
        b2 = torch.randn(count, H, device=device, generator=gen) * 0.1
        packed = quantize_experts(GPT_OSS_MXFP4, w1, w2, b1, b2)
        del w1, w2
        d1, d2 = dequantize_experts(GPT_OSS_MXFP4, packed, H)
        for name, tensor in packed.items():
            mxfp4.setdefault(name, []).append(tensor)
        for name, tensor in (("w1", d1.to(dense_dtype)), ("w2", d2.to(dense_dtype)), ("w1_bias", b1), ("w2_bias", b2)):
            dense.setdefault(name, []).append(tensor)
        del d1, d2
    return ({k: torch.cat(v).contiguous() for k, v in mxfp4.items()},
            {k: torch.cat(v).contiguous() for k, v in dense.items()})  # fmt: skip


def deepseek_layer(shape: dict, device, gen) -> dict[str, torch.Tensor]:
    """One layer's random e4m3 experts with fp32 128x128 block scales (`FP8_BLOCK_128`'s tensors)."""
    E, H, inter = shape["experts"], shape["hidden"], shape["inter"]
    out = {}
    for name, size in (("w1", (E, 2 * inter, H)), ("w2", (E, H, inter))):
        tensor = torch.empty(size, dtype=torch.float8_e4m3fn, device=device)
        for start in range(0, E, 16):  # 16-bit staging in chunks, not all at once
            chunk = tensor[start : start + 16]
            chunk.copy_(torch.randn(chunk.shape, device=device, generator=gen, dtype=torch.float16))
        out[name] = tensor
        blocks = (E, -(-size[1] // 128), -(-size[2] // 128))
        out[f"{name}_scale"] = (torch.rand(blocks, device=device, generator=gen) + 0.5) * size[2] ** -0.5
    return out


def store_of(weights: dict[str, torch.Tensor], device: torch.device) -> CPUBackingStore:
    _, layout = layout_from_weights(weights)
    return CPUBackingStore(layout, weights, pin=device.type == "cuda")


def gpt_oss_apply_torch(hidden: torch.Tensor, results: Iterable[ExpertWeightResult], topk_weights: torch.Tensor):
    """GPT-OSS's expert MLP on 16-bit weights in torch, over a call's passes; graph-capturable.

    Gathers each (token, choice)'s weights (``w1[ids]`` ``[T*K, 2I, H]``): every weight read
    is also written and read again. Biases ``w1_bias``, ``w2_bias`` come from ``extra``.
    """
    tokens, top_k = topk_weights.shape
    x = hidden.repeat_interleave(top_k, dim=0)  # [T*K, H], pair p = t*K + k
    total = torch.zeros(tokens * top_k, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for result in results:
        ids = result.topk_ids.reshape(-1)
        served = (ids >= 0) & (ids < result.num_slots)
        safe = torch.where(served, ids, 0).long()
        w1, w2 = result.w1[safe], result.w2[safe]  # [T*K, 2I, H], [T*K, H, I]
        h = torch.bmm(w1, x.to(w1.dtype)[:, :, None])[..., 0].float() + result.extra["w1_bias"][safe].float()
        gate = h[:, 0::2].clamp(max=GPT_OSS_MXFP4.limit)
        up = h[:, 1::2].clamp(-GPT_OSS_MXFP4.limit, GPT_OSS_MXFP4.limit)
        act = (up + 1) * gate * torch.sigmoid(gate * GPT_OSS_MXFP4.alpha)
        y = torch.bmm(w2, act.to(w2.dtype)[:, :, None])[..., 0].float() + result.extra["w2_bias"][safe].float()
        total += torch.where(served[:, None], y, 0.0)
    weighted = total.view(tokens, top_k, -1) * topk_weights.float()[:, :, None]
    return weighted.sum(dim=1).to(hidden.dtype)


# -- variants ---------------------------------------------------------------------------------------


def stack_with(template: DecodeStack, providers: list, apply: Callable) -> DecodeStack:
    """``template``'s dense parts with other providers and apply (drawing them again takes seconds)."""
    stack = copy.copy(template)
    stack.providers, stack.apply = list(providers), apply
    return stack


def cached_providers(family: Family, slots: int, shared: bool, device: torch.device) -> list:
    """Device-mode providers: per-layer pools of ``slots``, or one pool of ``slots`` for all layers."""
    if shared:
        pool = SlotPool(family.stores[0].layout, slots, device=device, mode="device")
        return [CachedWeightProvider(s, pool=pool, layer=index) for index, s in enumerate(family.stores)]
    return [CachedWeightProvider(s, cache_size=slots, device=device, mode="device") for s in family.stores]


def budgets(shape: dict, fractions: list[float], rfc: bool) -> list[tuple[str, bool, int]]:
    """``(label, shared, MXFP4 slots)``: slots per layer, or in all layers' one pool when shared."""
    E, L = shape["experts"], shape["layers"]
    rfc_slots = max(1, round(RFC_SLOTS * L / RFC_LAYERS))
    out = [(f"{rfc_slots} slots (RFC)", True, rfc_slots)] if rfc else []
    for fraction in fractions:
        per_layer = max(1, round(fraction * E))
        out += [(f"{fraction:.0%}", False, per_layer), (f"{fraction:.0%}", True, per_layer * L)]
    return out


def total_stats(providers) -> CacheStats:
    return sum((p.stats for p in providers), CacheStats())


def stats_delta(after: CacheStats, before: CacheStats) -> CacheStats:
    return CacheStats(**{f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)})


def measure(section: Section, family: Family, providers: list, routing: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Warm up, time ``section.steps`` steps, run the check step: ``(row, check output fp32)``."""
    warmup, steps, device = section.warmup, section.steps, section.device
    stack = stack_with(section.template, providers, family.apply)
    hidden = section.hidden
    step = GraphedDecodeStep(stack, hidden[0], routing[:1]) if section.graphs else stack.step
    for index in range(warmup):
        step(hidden[index], routing[index])
    before = total_stats(providers)

    def run() -> None:
        for index in range(warmup, warmup + steps):
            step(hidden[index], routing[index])

    ms = timed_ms(run, device) / steps
    delta = stats_delta(total_stats(providers), before)
    output = step(section.check_hidden, routing[warmup]).float().clone()  # the first timed token's ids
    copied = delta.bytes_h2d / steps  # per step
    row = {"ms_per_step": ms, "tok_per_s": 1e3 * routing.shape[2] / ms, "hit_rate": delta.hit_rate,
           "mb_per_token": copied / routing.shape[2] / 1e6, "copy_ms": copied / (section.copy_gbps * 1e6),
           "overflows": delta.overflows}  # fmt: skip
    return row, output


def run_row(section: Section, family: Family, label: dict, build: Callable[[], list], routing, reference: dict) -> dict:
    """One variant; a failure is a row with its error, not the end of the run.

    ``reference`` maps (family, routing) -> (resident ms, resident output), filled by the
    resident rows, read by the cached ones (bound and check).
    """
    start = time.perf_counter()
    row = {"model": section.shape["name"], "layers": section.shape["layers"], "format": family.name,
           "apply": family.apply_name, "expert_mb": family.expert_bytes / 1e6, "pinned_gbps": section.copy_gbps,
           "warmup": section.warmup, "steps": section.steps, **label}  # fmt: skip
    try:
        providers = build()
        measured, output = measure(section, family, providers, routing)
        row |= measured
    except Exception as err:  # report it and go on with the next variant
        sync(section.device)
        row["error"] = error_text(err)
        output = None
    key = (family.name, family.apply_name, label["routing"])
    if label["pool"] == "resident" and output is not None:
        reference[key] = (row["ms_per_step"], output)
    if output is not None and key in reference:
        finish_row(row, output, reference[key])
    print(f"  {family.name} {label['pool']} {label['budget']} {label['routing']}: {time.perf_counter() - start:.1f} s",
          flush=True)  # fmt: skip
    providers = None
    gc.collect()
    if section.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def finish_row(row: dict, output: torch.Tensor, resident: tuple[float, torch.Tensor]) -> None:
    resident_ms, reference = resident
    row["bound_serial_ms"] = resident_ms + row["copy_ms"]
    row["ratio_serial"] = row["ms_per_step"] / row["bound_serial_ms"]
    row["bound_max_ms"] = max(resident_ms, row["copy_ms"])
    row["ratio_max"] = row["ms_per_step"] / row["bound_max_ms"]
    row["rel_err"] = relative_error(output, reference)


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return (output - reference).abs().max().item() / max(reference.abs().max().item(), 1e-30)


def run_family(section: Section, family: Family, routing_name: str, routing, cached: list, reference: dict) -> list:
    """The resident row, then one row per budget in ``cached`` (``(label, shared, slots)``)."""
    base = {"routing": routing_name}
    rows = [run_row(section, family, {**base, "pool": "resident", "budget": "all", "slots": "all",
                                      "pool_gb": sum(t.nbytes for w in family.resident for t in w.values()) / 1e9},
                    lambda: [FullGPUProvider(w) for w in family.resident], routing, reference)]  # fmt: skip
    E, K = section.shape["experts"], section.shape["top_k"]
    for budget, shared, slots in cached:
        label = {**base, "pool": "global" if shared else "per layer", "budget": budget, "slots": slots,
                 "pool_gb": slots * family.expert_bytes * (1 if shared else len(family.stores)) / 1e9,
                 "passes": max_passes(K, E, slots)}  # fmt: skip
        build = functools.partial(cached_providers, family, slots, shared, section.device)
        rows.append(run_row(section, family, label, build, routing, reference))
    return rows


# -- sections ---------------------------------------------------------------------------------------


def make_section(shape: dict, args, device: torch.device, dtype: torch.dtype, store: CPUBackingStore) -> Section:
    """Inputs, dense parts (drawn once) and the bound's bandwidth, measured on ``store``."""
    gen = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(args.warmup + args.steps, 1, shape["hidden"], device=device, generator=gen).to(dtype)
    check = torch.randn(1, shape["hidden"], device=device, generator=gen).to(dtype)
    template = DecodeStack([None] * shape["layers"], shape["hidden"], shape["experts"], dtype=dtype, device=device)
    small, layer = copy_bandwidth_gbps(store, device)
    print(f"pinned copy-engine bandwidth {small:.1f} GB/s (64 MiB), {layer:.1f} GB/s (one layer's store, "
          f"{store.nbytes / 1e9:.2f} GB)", flush=True)  # fmt: skip
    return Section(shape, device, template, hidden, check, max(small, layer), device.type == "cuda", args.warmup,
                   args.steps)  # fmt: skip


def run_section(section: Section, families: list[Family], cached: list[list], routing_sets: dict, save) -> list[dict]:
    """Every family (with its budgets) on every routing; rows handed to ``save`` as they come."""
    rows: list[dict] = []
    reference: dict = {}
    for routing_name, ids in routing_sets.items():
        routing = torch.from_numpy(ids).to(section.device)[:, :, None, :]  # [N, L, 1, K]
        for family, budget_list in zip(families, cached, strict=True):
            new = run_family(section, family, routing_name, routing, budget_list, reference)
            first = reference.get((families[0].name, families[0].apply_name, routing_name))
            own = reference.get((family.name, family.apply_name, routing_name))
            if family is not families[0] and first is not None and own is not None:
                new[0]["rel_err"] = relative_error(own[1], first[1])  # another format or apply, the same MLP
            rows += new
            save(new)
    return rows


def build_gpt_oss(shape: dict, device: torch.device, dense_dtype: torch.dtype) -> list[Family]:
    """MXFP4 and 16-bit families of one random GPT-OSS-shaped model (pinned stores, device copies)."""
    start = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    mxfp4, dense = zip(*(gpt_oss_layer(shape, device, gen, dense_dtype) for _ in range(shape["layers"])), strict=True)
    mxfp4_stores, dense_stores = [store_of(w, device) for w in mxfp4], [store_of(w, device) for w in dense]
    sync(device)
    name16 = str(dense_dtype).removeprefix("torch.")
    families = [
        Family("mxfp4", "moe_apply_quant_passes", functools.partial(moe_apply_quant_passes, scheme=GPT_OSS_MXFP4),
               mxfp4_stores, list(mxfp4)),
        Family(name16, "moe_apply_quant_passes", functools.partial(moe_apply_quant_passes, scheme=GPT_OSS_BF16),
               dense_stores, list(dense)),
        Family(name16, "gpt_oss_apply_torch", gpt_oss_apply_torch, dense_stores, list(dense)),
    ]  # fmt: skip
    mx_bytes, dense_bytes = families[0].expert_bytes, families[1].expert_bytes
    print(f"{shape['name']}: {shape['layers']} layers x {shape['experts']} experts, top-{shape['top_k']}, "
          f"H = I = {shape['hidden']}; {mx_bytes / 1e6:.2f} MB per MXFP4 expert, {dense_bytes / 1e6:.2f} MB per "
          f"{name16} expert ({dense_bytes / mx_bytes:.2f}x); {sum(s.nbytes for s in mxfp4_stores) / 1e9:.2f} + "
          f"{sum(s.nbytes for s in dense_stores) / 1e9:.2f} GB built and pinned in "
          f"{time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    return families


def gpt_oss_section(args, device: torch.device, dtype: torch.dtype, save: Callable[[list], object]) -> list[dict]:
    shape = dict(TINY_GPT_OSS if args.dry_run else GPT_OSS_20B)
    shape["layers"] = args.layers or shape["layers"]
    # the 16-bit format: bf16 (fp16 in a dry run: the interpreter's bf16 arithmetic is wrong; same bytes)
    families = build_gpt_oss(shape, device, torch.float16 if args.dry_run else torch.bfloat16)
    if args.skip_torch_reference:
        families = families[:2]
    section = make_section(shape, args, device, dtype, families[0].stores[0])
    mx_budgets = budgets(shape, args.fractions, rfc=True)
    ratio = families[0].expert_bytes / families[1].expert_bytes  # the same GPU bytes: ~3.8x fewer slots
    dense_budgets = [(label, shared, max(1, int(slots * ratio))) for label, shared, slots in mx_budgets]
    cached = [mx_budgets, dense_budgets, []][: len(families)]  # the torch MLP: resident only
    routing_sets = routings(shape, args.routings, args.warmup + args.steps, deepseek=False)
    return run_section(section, families, cached, routing_sets, save)


def deepseek_section(args, device: torch.device, dtype: torch.dtype, save: Callable[[list], object]) -> list[dict]:
    shape = dict(TINY_DEEPSEEK if args.dry_run else DEEPSEEK_V3)
    shape["layers"] = args.deepseek_layers or shape["layers"]
    start = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(2)
    resident = [deepseek_layer(shape, device, gen) for _ in range(shape["layers"])]
    stores = [store_of(w, device) for w in resident]
    sync(device)
    families = [
        Family("fp8", "moe_apply_quant_passes", functools.partial(moe_apply_quant_passes, scheme=FP8_BLOCK_128),
               stores, resident),
        Family("fp8", "moe_apply_passes (old)", moe_apply_passes, stores, resident),
    ]  # fmt: skip
    print(f"{shape['name']}: {shape['layers']} layers x {shape['experts']} experts, top-{shape['top_k']}, "
          f"{families[0].expert_bytes / 1e6:.2f} MB per expert; {sum(s.nbytes for s in stores) / 1e9:.2f} GB built "
          f"and pinned in {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    section = make_section(shape, args, device, dtype, stores[0])
    per_layer = [b for b in budgets(shape, args.fractions, rfc=False) if not b[1]]
    routing_sets = routings(shape, args.routings, args.warmup + args.steps, deepseek=True)
    first = dict(list(routing_sets.items())[:1])  # a short point: one routing
    return run_section(section, families, [per_layer, per_layer], first, save)


# -- main ---------------------------------------------------------------------------------------------

COLUMNS = ["format", "apply", "routing", "pool", "budget", "slots", "pool_gb", "passes", "hit_rate", "mb_per_token",
           "ms_per_step", "tok_per_s", "copy_ms", "bound_serial_ms", "ratio_serial", "bound_max_ms", "ratio_max",
           "rel_err", "error"]  # fmt: skip


def side_by_side(rows: list[dict], left: Callable, right: Callable, names: tuple[str, str]) -> list[dict]:
    """Rows of ``left`` and ``right`` (predicates) at the same routing, pool and budget, paired."""

    def key(row: dict) -> tuple:
        return row["routing"], row["pool"], row["budget"]

    lefts = {key(r): r for r in rows if left(r) and "ms_per_step" in r}
    out = []
    for r in rows:
        if right(r) and "ms_per_step" in r and key(r) in lefts:
            a, (x, y) = lefts[key(r)], names
            out.append({"routing": r["routing"], "pool": r["pool"], "budget": r["budget"], f"{x}_slots": a["slots"],
                        f"{y}_slots": r["slots"], f"{x}_mb_per_token": a["mb_per_token"],
                        f"{y}_mb_per_token": r["mb_per_token"], f"{x}_tok_per_s": a["tok_per_s"],
                        f"{y}_tok_per_s": r["tok_per_s"], f"{x}_ratio_serial": a.get("ratio_serial", ""),
                        f"{y}_ratio_serial": r.get("ratio_serial", ""),
                        f"{x}_speedup_over_{y}": r["ms_per_step"] / a["ms_per_step"]})  # fmt: skip
    return out


def print_comparisons(rows: list[dict]) -> None:
    """MXFP4 vs bf16 at the same GPU bytes (one apply, two formats); DeepSeek's new vs old apply."""
    pairs = [
        ("GPT-OSS: MXFP4 vs 16-bit experts at the same GPU bytes (moe_apply_quant_passes)",
         lambda r: r["format"] == "mxfp4",
         lambda r: r["format"] in ("bfloat16", "float16") and r["apply"] == "moe_apply_quant_passes",
         ("mxfp4", "bf16")),
        ("DeepSeek-V3 fp8: moe_apply_quant_passes vs moe_apply_passes (old)",
         lambda r: r["format"] == "fp8" and r["apply"] == "moe_apply_quant_passes",
         lambda r: r["format"] == "fp8" and r["apply"].endswith("(old)"), ("new", "old")),
    ]  # fmt: skip
    for title, left, right, names in pairs:
        paired = side_by_side(rows, left, right, names)
        if paired:
            print_table(paired, list(paired[0]), title=title)


def save_rows(section: str, rows: list[dict]) -> None:
    append_csv("bench_quant", [{"section": section, **row} for row in rows])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=("gpt-oss", "deepseek"), default=["gpt-oss", "deepseek"])
    parser.add_argument("--routings", nargs="+", choices=("trace", "uniform"), default=["trace", "uniform"],
                        help="GPT-OSS routings; DeepSeek runs the first")  # fmt: skip
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--layers", type=int, default=None, help="GPT-OSS layers (default 24; 3 in a dry run)")
    parser.add_argument("--deepseek-layers", type=int, default=None, help="default 4 (2 in a dry run)")
    parser.add_argument("--warmup", type=int, default=32, help="untimed graph steps first (cache warm-up)")
    parser.add_argument("--steps", type=int, default=48, help="timed steps per variant")
    parser.add_argument("--skip-torch-reference", action="store_true",
                        help="skip the bf16 resident step with GPT-OSS's MLP in torch")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, interpreted kernels")
    args = parser.parse_args()
    if args.dry_run:
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 1)
        if args.fractions == parser.get_default("fractions"):
            args.fractions = [0.25]
    return args


def main() -> None:
    args = parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench_quant needs a CUDA GPU (use --dry-run to check the plumbing on a CPU)")
    if args.dry_run:  # nothing of a CPU check lands among the results
        _common.RESULTS = Path(tempfile.mkdtemp(prefix="bench_quant_dry_"))
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    start = time.perf_counter()
    print(ANCHOR, flush=True)
    rows = []
    sections = {"gpt-oss": gpt_oss_section, "deepseek": deepseek_section}
    for name in args.sections:
        new = sections[name](args, device, dtype, functools.partial(save_rows, name))
        if not new:
            continue
        title = (f"{new[0]['model']} decode, batch 1, device-mode cache inside one CUDA graph; "
                 f"serial bound = resident step (same format and apply) + copied bytes / pinned bandwidth")  # fmt: skip
        print_table(new, COLUMNS, title=title)
        rows += new
        gc.collect()  # this section's stores and device weights go before the next is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_comparisons(rows)
    cached = [r for r in rows if r.get("pool") != "resident" and "rel_err" in r]
    exact = all(r["rel_err"] == 0 for r in cached)
    print(f"\ncheck: every cached step's output equals its resident step's bit for bit: {exact}")
    first: dict[str, tuple] = {}  # model -> (format, apply) of its first row
    for row in rows:
        own = first.setdefault(row["model"], (row["format"], row["apply"]))
        if row.get("pool") == "resident" and (row["format"], row["apply"]) != own:
            print(f"check: resident {row['format']} {row['apply']} vs the section's first resident row "
                  f"({row['routing']}): rel err {row.get('rel_err', float('nan')):.2e}")  # fmt: skip
    print(ANCHOR)
    print(f"CSV: {_common.RESULTS / 'bench_quant.csv'}\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
