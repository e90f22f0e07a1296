"""Lossless exponent coding on the GPU: ratio by tensor kind, decode-copy throughput, DFloat11.

Three parts, one process, side by side:

  (a) ratio: coded / raw bytes of one expert record, per tensor kind (w1 = gate_up,
      w2 = down, biases) of normal-initialised bf16 weights at several scales and of each
      random family's experts (`expertcache.integrations.transformers.random_models`).
      Bound: the exponent's Shannon entropy with the literal kept verbatim,
      ``(16 - exponent bits + H) / 16``. Beside it DFloat11's ratio (one Huffman table
      per tensor, coded with its own encoder) on the same expert's tensor.
  (b) decode copy: bursts of 1, 2, 8, 32 Qwen3-30B-A3B experts (w1 [1536, 2048], w2
      [2048, 768] bf16) from pinned memory into GPU slots: the decoding copy kernel at
      ``num_programs`` 32/64/132/264 x num_warps 4/8/16 against the plain copy kernel and
      the copy engine on the raw bytes. Raw GB/s = bytes delivered into slots per second;
      read GB/s = bytes read over PCIe per second. Bound: the pinned copy-engine bandwidth
      for the bytes read, so raw GB/s <= pinned / ratio. Every variant's slots are checked
      bit for bit against the weights.
  (c) DFloat11's GPU decode of the same w1 tensor (device-resident input, and with the
      compressed bytes first copied from pinned memory), beside our kernel on that tensor.

DFloat11 runs when its wheel (and dahuffman; cupy for its kernel) are importable; every
call is guarded and a failure reads "unavailable: <reason>". num_warps is swept by
replacing the launcher's `warps_for` in this process (the launcher takes no warps).

    python benchmarks/bench_compression.py [--scales 0.002 0.02 ...] [--repeats 20]
    python benchmarks/bench_compression.py --dry-run    (CPU, tiny, interpreted: a check, ~1 min)
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import dfloat11_baseline  # noqa: E402
from _common import append_csv, cuda_time_ms, pinned_copy_gbps, print_table  # noqa: E402

from expertcache.exponent_analysis import analyse  # noqa: E402
from expertcache.exponent_code import FLOAT16_FIELDS, ExponentCode  # noqa: E402
from expertcache.kernels.copy_experts import CopyPlan, copy_experts  # noqa: E402
from expertcache.kernels.decode_copy import build_decode_segments, decode_copy, scratch_bytes  # noqa: E402
from expertcache.layout import layout_from_weights  # noqa: E402
from expertcache.mover import CopyGroup, DecodeGroup, copy_groups, copy_pairs  # noqa: E402
from expertcache.store import CPUBackingStore  # noqa: E402

# the module (``expertcache.kernels.decode_copy`` as an attribute is the exported launcher)
decode_module = importlib.import_module("expertcache.kernels.decode_copy")

QWEN3 = dict(name="Qwen3-30B-A3B", hidden=2048, inter=768, store_experts=64, bursts=(1, 2, 8, 32))
TINY = dict(name="tiny (dry run)", hidden=64, inter=48, store_experts=6, bursts=(1, 2))
GRID = dict(programs=(32, 64, 132, 264), warps=(4, 8, 16))
TINY_GRID = dict(programs=(2, 3), warps=(4,))
POISON = 0xFF


def exponent_entropy_bound(tensor: torch.Tensor) -> float:
    """``(16 - exponent bits + H) / 16``: the ratio of an ideal exponent-only code (H: the
    Shannon entropy of the tensor's exponents in bits)."""
    exponent_bits, mantissa_bits = FLOAT16_FIELDS[tensor.dtype]
    words = tensor.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    counts = torch.bincount(((words >> mantissa_bits) & ((1 << exponent_bits) - 1)).flatten()).double()
    p = counts[counts > 0] / counts.sum()
    return (16 - exponent_bits + float(-(p * p.log2()).sum())) / 16


def ratio_row(kind: str, source: str, tensor: torch.Tensor) -> dict:
    """Our ratio (per expert record, over every expert), the bound, DFloat11's on expert 0."""
    fmt = analyse(tensor, ExponentCode(tensor.dtype)).format
    return {
        "source": source,
        "kind": kind,
        "shape": "x".join(map(str, tensor.shape)),
        "ratio": fmt.record_bytes / fmt.raw_bytes if fmt.values else float("nan"),
        "stored_raw": not fmt.pays(),  # the store keeps such a name raw (ratio 1)
        "entropy_bound": exponent_entropy_bound(tensor),
        "dfloat11_ratio": dfloat11_baseline.ratio(tensor[0]),
    }


def tensor_kinds(hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {"w1 gate_up": (2 * inter, hidden), "w2 down": (hidden, inter), "bias gate_up": (2 * inter,),
            "bias down": (hidden,)}  # fmt: skip


def ratio_rows(shape: dict, scales: list[float], device: torch.device, families: bool) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for scale in scales:
        for kind, size in tensor_kinds(shape["hidden"], shape["inter"]).items():
            tensor = (torch.randn(8, *size, generator=gen, device=device) * scale).to(torch.bfloat16)
            rows.append(ratio_row(kind, f"randn*{scale:g}", tensor))
    if families:
        rows += family_rows(device)
    return rows


def family_rows(device: torch.device) -> list[dict]:
    """Each random family's bf16 expert tensors (its default init), 8 experts, H 512, I 384."""
    try:
        from expertcache.integrations.transformers.discovery import find_expert_blocks
        from expertcache.integrations.transformers.random_models import FAMILIES, ModelSizes, random_model
    except ImportError as error:
        print(f"families skipped: {error}")
        return []
    sizes = ModelSizes(num_moe_layers=1, num_experts=8, hidden=512, intermediate=384, vocab=128)
    rows = []
    for family in FAMILIES:
        block = find_expert_blocks(random_model(family, sizes, dtype=torch.bfloat16))[0]
        for name in block.parameter_names:
            tensor = block.module.get_parameter(name).detach()
            if tensor.dtype == torch.bfloat16:
                rows.append(ratio_row(name, family, tensor.to(device)))
    return rows


@contextlib.contextmanager
def decode_warps(warps: int | None) -> Iterator[None]:
    """Launch the decoding kernel with ``warps`` warps (None: the launcher's choice)."""
    chosen = decode_module.warps_for
    if warps is not None:
        decode_module.warps_for = lambda block: warps
    try:
        yield
    finally:
        decode_module.warps_for = chosen


def timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    """Median ms of a call: CUDA events on a GPU; one wall-clock call when interpreted."""
    if device.type == "cuda":
        return lambda run: cuda_time_ms(run, repeats=repeats)

    def wall(run: Callable[[], object]) -> float:
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3

    return wall


class Burst:
    """One burst: ``count`` experts of the store into random slots, and the check of the slots."""

    def __init__(self, count: int, weights: dict, slots: dict, device: torch.device, gen: torch.Generator) -> None:
        num_experts, num_slots = next(iter(weights.values())).shape[0], next(iter(slots.values())).shape[0]
        self.experts = torch.randperm(num_experts, generator=gen)[:count]
        self.slot_ids = torch.randperm(num_slots, generator=gen)[:count]
        self.plan = CopyPlan(torch.tensor([count], dtype=torch.int32, device=device),
                             self.experts.int().to(device), self.slot_ids.int().to(device), 1)  # fmt: skip
        self.weights, self.slots = weights, slots

    def reset(self) -> None:
        for tensor in self.slots.values():
            tensor.view(torch.uint8).fill_(POISON)

    def exact(self) -> bool:
        """Planned slots hold the experts' exact bits, every other slot still the poison."""
        for name, tensor in self.slots.items():
            expected = torch.full_like(tensor.view(torch.uint8), POISON).view(tensor.dtype)
            expected[self.slot_ids.to(tensor.device)] = self.weights[name][self.experts.to(tensor.device)]
            if not torch.equal(tensor.view(torch.int16), expected.view(torch.int16)):
                return False
        return True


def copy_rows(shape: dict, grid: dict, device: torch.device, repeats: int, pinned_gbps: float) -> tuple:
    """Part (b): every variant on every burst, checked and timed. Returns (rows, the
    weights, the coded store, its record ratio)."""
    gen = torch.Generator(device=device).manual_seed(1)
    E, H, inter = shape["store_experts"], shape["hidden"], shape["inter"]
    weights = {
        "w1": (torch.randn(E, 2 * inter, H, generator=gen, device=device) * H**-0.5).to(torch.bfloat16),
        "w2": (torch.randn(E, H, inter, generator=gen, device=device) * inter**-0.5).to(torch.bfloat16),
    }
    _, layout = layout_from_weights(weights)
    pin = device.type == "cuda"
    raw = CPUBackingStore(layout, weights, pin=pin)
    sync()
    start = time.perf_counter()
    coded = CPUBackingStore(layout, weights, pin=pin, compression="exponent")
    sync()
    seconds = time.perf_counter() - start
    print(f"coded {E} experts ({raw.nbytes / 1e9:.2f} GB raw -> {coded.nbytes / 1e9:.2f} GB) on {device} in "
          f"{seconds:.2f} s: {raw.nbytes / seconds / 1e9:.2f} GB/s of raw bytes, pinning included")  # fmt: skip
    copy_group = next(g for g in copy_groups(raw, device) if isinstance(g, CopyGroup))
    decode_group = next(g for g in copy_groups(coded, device) if isinstance(g, DecodeGroup))
    scratch = torch.empty(scratch_bytes(decode_group.segments, max(grid["programs"])), dtype=torch.uint8, device=device)
    slots = layout.allocate(max(shape["bursts"]), device, POISON)
    names = list(decode_group.names)
    time_ms = timer(device, repeats)
    rows = []
    for count in shape["bursts"]:
        burst = Burst(count, weights, slots, device, torch.Generator().manual_seed(count))
        raw_bytes, read_coded = count * layout.expert_bytes, count * coded.stored_expert_bytes
        pairs = [(slots[n][s], raw.tensors[n][e]) for e, s in zip(burst.experts.tolist(), burst.slot_ids.tolist(),
                                                                   strict=True) for n in slots]  # fmt: skip
        variants: list[tuple[str, int | None, int | None, int, Callable[[], object]]] = [
            ("copy engine, raw", None, None, raw_bytes, lambda pairs=pairs: copy_pairs(pairs))
        ]
        for programs in grid["programs"]:
            run = functools.partial(copy_experts, raw.buffer, [slots[n] for n in copy_group.names], burst.plan,
                                    copy_group.segments, unit=copy_group.unit or layout.copy_unit,
                                    num_experts=raw.num_experts, num_programs=programs)  # fmt: skip
            variants.append(("copy kernel, raw", programs, None, raw_bytes, run))
        for programs in grid["programs"]:
            for warps in grid["warps"]:
                run = functools.partial(decode_copy, coded.buffer, [slots[n] for n in names], burst.plan,
                                        decode_group.segments, num_experts=coded.num_experts, scratch=scratch,
                                        num_programs=programs)  # fmt: skip
                variants.append(("decode copy, coded", programs, warps, read_coded, run))
        for variant, programs, warps, read, run in variants:
            with decode_warps(warps):
                burst.reset()
                run()
                sync()
                exact = burst.exact()
                ms = time_ms(run)
            rows.append({"experts": count, "variant": variant, "programs": programs or "", "warps": warps or "",
                         "ms": ms, "raw_gbps": raw_bytes / ms / 1e6, "read_gbps": read / ms / 1e6,
                         "read_vs_pinned": read / ms / 1e6 / pinned_gbps, "exact": exact})  # fmt: skip
    ratio = coded.stored_expert_bytes / layout.expert_bytes
    print(f"record ratio {ratio:.4f}: raw-bytes bound of a decoding copy = {pinned_gbps:.1f} / {ratio:.4f} = "
          f"{pinned_gbps / ratio:.1f} GB/s")  # fmt: skip
    return rows, weights, coded, ratio


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def our_tensor_row(coded: CPUBackingStore, weights: dict, device: torch.device, repeats: int) -> dict:
    """Our decoding copy of w1 of expert 0 alone (the tensor DFloat11 decodes in part (c))."""
    fmt = coded.formats["w1"]
    offset = coded.region_offsets[[s.name for s in coded.layout.specs].index("w1")]
    segments = build_decode_segments((offset,), (fmt,))
    slot = torch.full((1, *weights["w1"].shape[1:]), float("nan"), dtype=torch.bfloat16, device=device)
    plan = CopyPlan(*(torch.tensor([v], dtype=torch.int32, device=device) for v in (1, 0, 0)), 1)
    run = functools.partial(decode_copy, coded.buffer, [slot], plan, segments, num_experts=coded.num_experts)
    run()
    sync()
    ms = timer(device, repeats)(run)
    exact = torch.equal(slot[0].view(torch.int16), weights["w1"][0].view(torch.int16))
    raw = weights["w1"][0].nbytes
    return {"decoder": "expertcache decode_copy (pinned -> slot)", "ratio": fmt.record_bytes / raw, "ms": ms,
            "raw_gbps": raw / ms / 1e6, "exact": exact}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.002, 0.006, 0.0221, 0.05, 0.1],
                        help="std of the normal weights (0.0221 = 2048**-0.5)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20, help="timed launches per variant (median)")
    parser.add_argument("--skip-families", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, interpreted kernels")
    args = parser.parse_args()
    if args.dry_run:
        device, shape, grid = torch.device("cpu"), TINY, TINY_GRID
        _common.RESULTS = Path(tempfile.mkdtemp(prefix="bench_compression_dry_"))
        args.scales, args.repeats = args.scales[:2], 1
    elif torch.cuda.is_available():
        device, shape, grid = torch.device("cuda"), QWEN3, GRID
    else:
        raise SystemExit("bench_compression needs a CUDA GPU (or --dry-run on a CPU)")
    stamp = _common.environment()
    print(f"{stamp['gpu']}, torch {stamp['torch']}, triton {stamp['triton']}, commit {stamp['commit']}; "
          f"DFloat11: {dfloat11_baseline.status()}")  # fmt: skip

    ratios = ratio_rows(shape, args.scales, device, families=not args.skip_families)
    print_table(ratios, list(ratios[0]), title="(a) coded / raw bytes per expert; bound: exponent entropy, "
                                               "literal verbatim; DFloat11 on expert 0")  # fmt: skip
    pinned = pinned_copy_gbps(256 * 2**20) if device.type == "cuda" else float("nan")
    copies, weights, coded, ratio = copy_rows(shape, grid, device, args.repeats, pinned)
    print_table(copies, list(copies[0]), title=f"(b) {shape['name']} bursts from pinned memory; bound: read GB/s "
                                               f"<= {pinned:.1f} (pinned copy engine, 256 MiB), raw GB/s <= "
                                               f"{pinned / ratio:.1f}")  # fmt: skip
    tensor_rows = [our_tensor_row(coded, weights, device, args.repeats)]
    tensor_rows += dfloat11_baseline.decode_rows(weights["w1"][0], device, timer(device, args.repeats))
    print_table(tensor_rows, ["decoder", "ratio", "ms", "raw_gbps", "exact", "note"],
                title=f"(c) one w1 tensor {tuple(weights['w1'].shape[1:])}: GPU decoders")  # fmt: skip
    bad = [r for r in copies + tensor_rows if r.get("exact") is False]
    common = {"shape": shape["name"], "pinned_gbps": pinned}
    print(f"CSV: {append_csv('bench_compression_ratio', [{**common, **r} for r in ratios])}")
    append_csv("bench_compression_copy", [{**common, "ratio": ratio, **r} for r in copies])
    append_csv("bench_compression_decoders", [{**common, **r} for r in tensor_rows])
    if bad:
        raise SystemExit(
            f"{len(bad)} variant(s) wrote wrong bytes: {[(r.get('variant'), r.get('decoder')) for r in bad]}"
        )
    if any(math.isnan(r["ratio"]) for r in ratios):
        print("note: a tensor with no values has no ratio")


if __name__ == "__main__":
    main()
