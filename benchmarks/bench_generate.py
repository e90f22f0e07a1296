"""Greedy decode speed and time to first token of a full-depth MoE model, served every way.

One model per process, random weights with a real model's expert shapes (small attention and
vocabulary, so memory is experts):

    qwen3-30b-a3b   48 layers x 128 experts of 2048 x 768, top-8, bf16 (9.4 MB per expert)
    gpt-oss-20b     24 layers x 32 experts of 2880 x 2880, top-4, bf16, with biases
    deepseek-v3     4 layers x 256 experts of 7168 x 2048, top-8 (one dense layer first, a shared
                    expert per layer)

``--experts-format`` quantizes the random experts on the device into a checkpoint's packed
format (`packed_models.quantize_experts`) before anything runs: ``fp8`` (e4m3, 128 x 128 block
scales, transformers' FP8Experts: Qwen3-MoE, DeepSeek-V3) or ``mxfp4`` (GPT-OSS's, our
Mxfp4Experts); every run then computes with the ``expertcache_quant`` kernels (resident too),
and the cache holds the packed bytes. No accelerate variant there (it offloads float weights).

Variants, side by side (``--variants`` picks some):

    resident-eager    every expert on the GPU, ``model.generate``
    resident-graphed  every expert on the GPU, `GraphedGenerator` (one CUDA-graph replay a token)
    cache-eager       the expert cache at each ``--fractions`` x ``--budgets``, ``model.generate``
    cache-graphed     the same device-mode cache inside `GraphedGenerator`'s graphs
    accelerate        accelerate offload (infer_auto_device_map + dispatch_model) at the GPU
                      budget of the smallest cache
    *-ttft            time to first token of a ``--ttft-tokens`` prompt: resident-ttft,
                      cache-ttft (each cache), accelerate-ttft (prefill is eager in every
                      variant, so graphed and eager share it)

Decode runs use ``--experts-implementation`` (batched_mm: what generate() decodes with on a
GPU, and the same computation everywhere, so the tokens must equal the resident run's; a
mismatch is reported). Prefill of the long TTFT prompt uses grouped_mm (batched_mm gathers
one weight copy per token and expert: 77 GB at 1024 x top-8 of Qwen3's experts); a served
model follows the switch, so one enable serves a cache's decode and TTFT runs, TTFT last (a
cache warmed by decoding, as in serving). Each decode run starts with a warm-up generation
(first calls, kernel compiles and graph capture stay out of the timing).

``--trace`` replays the real Qwen3-30B-A3B trace's routing (``../shared/traces``) through the
same model: every router's top-k ids are replaced by the trace's (cycled), read on the
device from a cursor the last MoE layer advances, so graphs replay it too. DeepSeek-V3 shapes
take it as ``bench_decode.py --shape deepseek-v3`` does (layer l: the first 4 ids of trace
layers 2l and 2l+1, the second set + 128). Without it random weights route close to
uniformly (Qwen3, GPT-OSS), a worst case for a cache; DeepSeek-V3's random router saturates
its sigmoid scores and picks nearly the same experts every token (measured: 98% hits at 25%),
a best case: use ``--trace`` there.

Two speeds per decode run: ``tok_per_s`` = new tokens / wall time of the whole call (prefill
included), and ``decode_tok_per_s`` = (N - 1) / (time of the call with N new tokens - time of
the same call with one), prefill excluded; the copies per decode token come from the same
difference of the cache's counts. ``x_resident``: the decode step over the resident step of
the same runner (eager or graphed); ``x_bound``: over that resident step + the step's copied
bytes at the pinned copy-engine bandwidth measured in the process (a 64 MiB copy): a layer's
misses are known only after its router, so copies and compute add up.

``--cache-sizes`` adds slot counts per layer to the fractions' (with ``global``: that many x
layers in one pool), e.g. the same GPU bytes as a packed model's cache.

Prints a table and appends one row per run, stamped with GPU name, versions and commit, to
``benchmarks/results/bench_generate.csv``. ``--dry-run``: a tiny model on the CPU in seconds
(graphed variants take the eager path, caches host mode, no accelerate, no CSV).

    python benchmarks/bench_generate.py --model qwen3-30b-a3b [--layers 48] [--trace]
    python benchmarks/bench_generate.py --model gpt-oss-20b --variants resident-eager cache-graphed
    python benchmarks/bench_generate.py --model gpt-oss-20b --experts-format mxfp4 --cache-sizes 10
    python benchmarks/bench_generate.py --model deepseek-v3 --experts-format fp8
    python benchmarks/bench_generate.py --dry-run [--trace] [--experts-format fp8|mxfp4]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_csv, environment, pinned_copy_gbps, print_table  # noqa: E402

STARTED = time.monotonic()

from expertcache.integrations.transformers import enable_expert_cache  # noqa: E402
from expertcache.integrations.transformers.generation import GenerationRun, greedy_generate  # noqa: E402
from expertcache.integrations.transformers.graphed import GraphedGenerator, timed_generate  # noqa: E402
from expertcache.integrations.transformers.packed_models import quantize_experts  # noqa: E402
from expertcache.integrations.transformers.quantized import QUANT_IMPLEMENTATION  # noqa: E402
from expertcache.integrations.transformers.random_models import ModelSizes, random_model  # noqa: E402
from expertcache.stats import CacheStats  # noqa: E402

PRESETS = {
    "qwen3-30b-a3b": dict(family="qwen3_moe", layers=48, experts=128, top_k=8, hidden=2048, intermediate=768),
    "gpt-oss-20b": dict(family="gpt_oss", layers=24, experts=32, top_k=4, hidden=2880, intermediate=2880),
    "deepseek-v3": dict(family="deepseek_v3", layers=4, experts=256, top_k=8, hidden=7168, intermediate=2048),
    # --dry-run: Qwen3's routing shape (so --trace works), tiny matrices
    "tiny": dict(family="qwen3_moe", layers=2, experts=128, top_k=8, hidden=32, intermediate=24),
    "tiny-gpt-oss": dict(family="gpt_oss", layers=2, experts=32, top_k=4, hidden=64, intermediate=32),
    "tiny-deepseek": dict(family="deepseek_v3", layers=2, experts=256, top_k=8, hidden=32, intermediate=24),
}
VARIANTS = ("resident-eager", "resident-graphed", "resident-ttft", "cache-eager", "cache-graphed", "cache-ttft",
            "accelerate", "accelerate-ttft")  # fmt: skip
COLUMNS = ("variant", "budget", "slots", "tok_per_s", "decode_tok_per_s", "x_resident", "x_bound", "ttft_s",
           "same_tokens", "hit_rate", "mb_copied", "mb_per_decode_token", "expert_mb_gpu", "peak_mb")  # fmt: skip
FORMATS = ("float", "fp8", "mxfp4")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a fraction of the experts, in (0, 1], got {value}")
    return value


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=None,
        help="default: qwen3-30b-a3b (gpt-oss-20b with --experts-format mxfp4)",
    )
    parser.add_argument("--layers", type=_positive, default=None, help="MoE layers (default: the model's)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (kept small: memory is experts)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=_positive, default=1)
    parser.add_argument("--prompt-tokens", type=_positive, default=32)
    parser.add_argument("--new-tokens", type=_positive, default=32)
    parser.add_argument(
        "--warmup-tokens",
        type=int,
        default=None,
        help="warm-up call's new tokens (default: --new-tokens: the timed calls then start from the cache "
        "state of an N-token call)",
    )
    parser.add_argument("--ttft-tokens", type=int, default=1024)
    parser.add_argument("--accelerate-new-tokens", type=int, default=4, help="accelerate decodes ~0.1-1 tok/s")
    parser.add_argument("--fractions", type=_fraction, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument(
        "--cache-sizes",
        type=int,
        nargs="+",
        default=[],
        help="slots per layer besides the fractions' (global: that many x layers in one pool)",
    )
    parser.add_argument(
        "--experts-format",
        choices=FORMATS,
        default="float",
        help="fp8: e4m3 128x128 blocks (FP8Experts); mxfp4: GPT-OSS's (Mxfp4Experts)",
    )
    parser.add_argument("--budgets", nargs="+", choices=("per-layer", "global"), default=["per-layer", "global"])
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=None, help="default: all (no accelerate for packed experts)"
    )
    parser.add_argument(
        "--eager-cache-mode",
        choices=("device", "host"),
        default=None,
        help="cache mode of cache-eager (default device: the graphed run's cache, one enable for both; "
        "host with --dry-run)",
    )
    parser.add_argument(
        "--experts-implementation",
        default=None,
        help="for every decode run (default: batched_mm; packed experts: expertcache_quant)",
    )
    parser.add_argument("--trace", action="store_true", help="route by the real Qwen3-30B-A3B trace")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, no CSV")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    args = parser.parse_args()
    packed = args.experts_format != "float"
    args.model = args.model or ("gpt-oss-20b" if args.experts_format == "mxfp4" else "qwen3-30b-a3b")
    needs = {"fp8": ("qwen3_moe", "deepseek_v3"), "mxfp4": ("gpt_oss",)}.get(args.experts_format)
    if needs and PRESETS[args.model]["family"] not in needs:
        parser.error(f"--experts-format {args.experts_format} needs a {' or '.join(needs)} model, not {args.model}")
    chosen_variants = args.variants is not None
    if args.variants is None:
        args.variants = [v for v in VARIANTS if not (packed and v.startswith("accelerate"))]
    elif packed and any(v.startswith("accelerate") for v in args.variants):
        parser.error("the accelerate variants offload float experts only: drop them with --experts-format")
    if args.experts_implementation is None:
        args.experts_implementation = QUANT_IMPLEMENTATION if packed else "batched_mm"
    # the long TTFT prompt: grouped_mm for float experts (see the docstring), packed: the kernels
    args.prefill_implementation = QUANT_IMPLEMENTATION if packed else "grouped_mm"
    if args.dry_run:
        if chosen_variants and any(v.startswith("accelerate") for v in args.variants):
            parser.error("--dry-run has no accelerate variant (it offloads to a CUDA device)")
        if args.eager_cache_mode == "device":
            parser.error("--dry-run runs the caches in host mode (device mode on a CPU is interpreted, slow)")
        family = PRESETS[args.model]["family"]
        args.model = {"gpt_oss": "tiny-gpt-oss", "deepseek_v3": "tiny-deepseek"}.get(family, "tiny")
        args.device = args.device or "cpu"
        args.heads, args.head_dim, args.vocab = 4, 8, 128
        args.prompt_tokens, args.new_tokens, args.warmup_tokens, args.ttft_tokens = 6, 6, 3, 24
        args.variants = [v for v in args.variants if not v.startswith("accelerate")]
        args.eager_cache_mode = "host"
    args.eager_cache_mode = args.eager_cache_mode or "device"
    try:
        args.device = torch.device(args.device or "cuda")
    except RuntimeError:
        parser.error(f"--device {args.device}: not a torch device (cpu, cuda, cuda:1, ...)")
    if args.warmup_tokens is None:  # the cache warmed over the tokens it is timed on (steady state)
        args.warmup_tokens = args.new_tokens
    for key, value in PRESETS[args.model].items():
        if getattr(args, key, None) is None:  # --layers overrides the preset's depth
            setattr(args, key, value)
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    wrong = [size for size in args.cache_sizes if not args.top_k <= size <= args.experts]
    if wrong:
        parser.error(f"--cache-sizes {wrong}: slots per layer go from the top-k {args.top_k} to {args.experts}")
    if args.trace and (args.family, args.experts, args.top_k) not in (("qwen3_moe", 128, 8), ("deepseek_v3", 256, 8)):
        parser.error("--trace replays the Qwen3-30B-A3B trace: it needs a qwen3-30b-a3b or deepseek-v3-shaped model")
    if any(v.startswith("accelerate") for v in args.variants) and args.device.type != "cuda":
        parser.error("the accelerate variant offloads to a CUDA device")
    return args


class TraceRouting:
    """Every MoE layer routed by a recorded trace: ``[N, L, K]`` ids on the device, cycled.

    Token ``t`` of the run (prompt tokens first) takes trace row ``t mod N``; the router still
    computes its logits and the weights are its probabilities at the trace's ids (normalised
    as the model does), so everything but the choice of experts is the model's own.
    """

    def __init__(self, ids, device: torch.device) -> None:
        self.ids = torch.as_tensor(ids, dtype=torch.long, device=device)
        self.cursor = torch.zeros((), dtype=torch.long, device=device)  # next trace row

    def install(self, model) -> None:
        gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]  # MoE layers
        if len(gates) > self.ids.shape[1] or gates[0].num_experts <= int(self.ids.max()):
            raise ValueError(f"the trace ({tuple(self.ids.shape)}) does not fit this model's {len(gates)} layers")
        for layer, gate in enumerate(gates):
            gate.forward = functools.partial(self._route, gate, layer, layer == len(gates) - 1)

    def reset(self) -> None:
        self.cursor.zero_()  # in place: captured graphs read this tensor

    def _route(self, gate, layer: int, last: bool, hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, gate.hidden_dim)
        rows = (self.cursor + torch.arange(hidden.shape[0], device=hidden.device)) % self.ids.shape[0]
        ids = self.ids[rows, layer]  # [T, K], gathered on the device: no host sync
        if last:
            self.cursor.add_(hidden.shape[0])
        if hasattr(gate, "e_score_correction_bias"):  # DeepSeek-V3: sigmoid scores in fp32, scaled
            logits = F.linear(hidden.float(), gate.weight.float())
            weights = logits.sigmoid().gather(1, ids)
            if gate.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return logits, weights * gate.routed_scaling_factor, ids
        logits = F.linear(hidden, gate.weight)  # Qwen3-MoE: softmax probabilities
        weights = logits.softmax(dim=-1, dtype=torch.float).gather(1, ids)
        if gate.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids


@dataclasses.dataclass
class Bench:
    """The model, its prompts and what every run is compared with."""

    args: argparse.Namespace
    model: object
    prompt: torch.Tensor  # [batch, prompt_tokens]
    ttft_prompt: torch.Tensor  # [1, ttft_tokens]
    routing: TraceRouting | None
    expert_bytes: int
    reference: torch.Tensor | None = None  # decode tokens of the first resident run
    ttft_reference: torch.Tensor | None = None

    def reset_routing(self) -> None:
        if self.routing is not None:
            self.routing.reset()


def _build(args) -> Bench:
    sizes = ModelSizes(
        num_moe_layers=args.layers, num_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
        intermediate=args.intermediate, vocab=args.vocab, heads=args.heads, head_dim=args.head_dim,
    )  # fmt: skip
    model = random_model(args.family, sizes, dtype=args.dtype, device=args.device)
    if args.experts_format != "float":  # the checkpoint's packed format, quantized on the device
        quantize_experts(model, args.experts_format, block=(128, 128))
    try:
        model.set_experts_implementation(args.experts_implementation)
    except ValueError as error:  # transformers names the ones it accepts
        print(f"bench_generate.py: error: --experts-implementation {args.experts_implementation}: {error}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    routing = None
    if args.trace:
        from bench_decode import shape_routing

        key = "deepseek-v3" if args.family == "deepseek_v3" else "qwen3-30b-a3b"
        routing = TraceRouting(shape_routing(key, args.layers), args.device)
        routing.install(model)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt_tokens), generator=generator)
    ttft_prompt = torch.randint(0, args.vocab, (1, args.ttft_tokens), generator=generator)
    expert_bytes = sum(p.nbytes for n, p in model.named_parameters() if ".experts." in n)
    return Bench(args, model, prompt.to(args.device), ttft_prompt.to(args.device), routing, expert_bytes)


@dataclasses.dataclass
class Measured:
    """A decode measurement: the timed call (prompt + N new tokens) and the same prompt with
    one new token (prefill and the first step); decode speed is their difference."""

    run: GenerationRun
    first: GenerationRun
    stats: CacheStats | None = None  # the cache's counts over ``run``
    first_stats: CacheStats | None = None  # over ``first``

    @property
    def step_seconds(self) -> float | None:
        """Wall time of one decode step (``B`` tokens), prefill excluded; None when the
        difference is not positive (the call's noise exceeds its decode time: a tiny model
        on a CPU), so that no negative speed or ratio is printed."""
        step = (self.run.seconds - self.first.seconds) / max(1, self.run.new_tokens - 1)
        return step if step > 0 else None

    @property
    def step_bytes(self) -> float | None:
        """Bytes the cache copied per decode step (the calls' difference, like the time)."""
        if self.stats is None or self.first_stats is None:
            return None
        return (self.stats.bytes_h2d - self.first_stats.bytes_h2d) / max(1, self.run.new_tokens - 1)


def _difference(after: CacheStats, before: CacheStats) -> CacheStats:
    names = [field.name for field in dataclasses.fields(CacheStats)]
    return CacheStats(**{name: getattr(after, name) - getattr(before, name) for name in names})


def _measure(bench: Bench, generate, handle=None) -> Measured:
    """``generate(n)`` after a warm-up call (first calls, compiles, graph capture), once with
    ``--new-tokens`` and then once with one new token, the routing trace restarted for each.

    Both timed calls start from the cache state an N-token call leaves (the warm-up's, then
    the first timed call's: same prompt, same routing), so their difference is N - 1 decode
    steps; timing the one-token call first let the N-token call find the prefill's experts
    just loaded (a global pool at 50%: fewer bytes in N tokens than in 1)."""

    def counted(tokens: int) -> tuple[GenerationRun, CacheStats | None]:
        bench.reset_routing()
        before = None if handle is None else handle.stats.total
        run = generate(tokens)
        return run, None if handle is None else _difference(handle.stats.total, before)

    counted(bench.args.warmup_tokens)
    run, stats = counted(bench.args.new_tokens)
    first, first_stats = counted(1)
    return Measured(run, first, stats, first_stats)


def _eager(bench: Bench, handle=None) -> Measured:
    return _measure(bench, lambda tokens: greedy_generate(bench.model, bench.prompt, tokens), handle)


def _graphed(bench: Bench, handle=None) -> Measured:
    runner = GraphedGenerator(
        bench.model, max_length=bench.prompt.shape[1] + bench.args.new_tokens, max_batch_size=bench.prompt.shape[0]
    )
    return _measure(bench, lambda tokens: timed_generate(runner, bench.prompt, tokens), handle)  # runner: this frame


def _row(bench: Bench, variant: str, measured, *, handle=None, budget="", slots="") -> dict:
    """One decode (`Measured`) or TTFT (`GenerationRun`) row; the tokens are checked against the
    first resident run's of the same phase."""
    ttft = isinstance(measured, GenerationRun)
    run = measured if ttft else measured.run
    if variant.startswith("resident"):  # the first resident run of each phase is the reference
        if ttft and bench.ttft_reference is None:
            bench.ttft_reference = run.tokens
        if not ttft and bench.reference is None:
            bench.reference = run.tokens
    reference = bench.ttft_reference if ttft else bench.reference
    if reference is not None:
        reference = reference[:, : run.tokens.shape[1]]  # accelerate makes fewer tokens
    same = "n/a" if reference is None else bool(torch.equal(run.tokens, reference))
    stats = None if handle is None or ttft else measured.stats
    step = None if ttft else measured.step_seconds  # None: not resolved (see Measured.step_seconds)
    step_bytes = None if ttft else measured.step_bytes
    row = {
        "variant": variant, "budget": budget, "slots": slots,
        "tok_per_s": "" if ttft else round(run.tokens_per_second, 2),
        "decode_tok_per_s": "" if step is None else round(bench.prompt.shape[0] / step, 2),
        "x_resident": "", "x_bound": "",  # filled in by _ratios
        "ttft_s": round(run.seconds, 4) if ttft else "",
        "same_tokens": same,  # n/a: no resident run of this phase in this process
        "hit_rate": "" if stats is None else round(stats.hit_rate, 4),
        "mb_copied": "" if stats is None else round(stats.bytes_h2d / 1e6, 1),
        "mb_per_decode_token": "" if step_bytes is None else round(step_bytes / bench.prompt.shape[0] / 1e6, 2),
        "expert_mb_gpu": round((bench.expert_bytes if handle is None else handle.slot_bytes) / 1e6, 1),
        "peak_mb": "" if run.peak_bytes is None else round(run.peak_bytes / 1e6, 1),
    }  # fmt: skip
    row["_step_s"] = step
    row["_step_bytes"] = step_bytes
    print(
        f"  {' '.join(map(str, (variant, budget, slots))).strip()}: "
        + ", ".join(f"{k} {row[k]}" for k in COLUMNS[3:] if row[k] != "")
        + f" ({time.monotonic() - STARTED:.0f} s into the process)",
        flush=True,
    )
    return row


def _ratios(rows: list[dict], copy_gbps: float) -> None:
    """Decode step over the resident step of the same runner (eager or graphed), and over the
    serial bound: that resident step + the step's copied bytes at the pinned bandwidth."""
    resident = {row["variant"].split("-")[1]: row["_step_s"] for row in rows
                if row["variant"] in ("resident-eager", "resident-graphed")}  # fmt: skip
    for row in rows:
        kind = row["variant"].split("-")[-1]
        if row["_step_s"] is None or resident.get(kind) is None:
            continue
        row["x_resident"] = round(row["_step_s"] / resident[kind], 3)
        if row["_step_bytes"] is not None:
            bound = resident[kind] + row["_step_bytes"] / (copy_gbps * 1e9)
            row["x_bound"] = round(row["_step_s"] / bound, 3)


def _ttft(bench: Bench) -> GenerationRun:
    """First token of the long prompt, after a warm-up prompt of the same length (other
    tokens: the kernels' tiles for that many tokens are compiled before the timing; a short
    warm-up left Triton compiling inside the timed call); prefilled with grouped_mm (packed
    experts: the kernels; served blocks follow the switch too), then back to the decode
    implementation."""
    bench.model.set_experts_implementation(bench.args.prefill_implementation)
    try:
        bench.reset_routing()
        greedy_generate(bench.model, (bench.ttft_prompt + 1) % bench.args.vocab, 1)
        bench.reset_routing()
        return greedy_generate(bench.model, bench.ttft_prompt, 1)
    finally:
        bench.model.set_experts_implementation(bench.args.experts_implementation)


def _cache_size(args, fraction: float) -> int:
    return max(args.top_k, round(fraction * args.experts))


def _mode(args) -> str:
    return "device" if args.device.type == "cuda" else "host"  # device mode on the CPU: interpreted, slow


def _cache_runs(bench: Bench, slots: int, budget: str) -> list[dict]:
    """One cache size and budget: eager and graphed decode, then TTFT, on one enable (the
    served blocks follow ``set_experts_implementation``, so TTFT prefills with grouped_mm)."""
    args, rows = bench.args, []
    label = {"budget": budget, "slots": slots}
    wanted = {variant for variant in args.variants if variant.startswith("cache-")}
    if "cache-eager" in wanted and args.eager_cache_mode != _mode(args):
        handle = enable_expert_cache(bench.model, cache_size=slots, budget=budget, mode=args.eager_cache_mode)
        rows.append(_row(bench, "cache-eager", _eager(bench, handle), handle=handle, **label))
        handle.disable()
        wanted.discard("cache-eager")
    if not wanted:
        return rows
    handle = enable_expert_cache(bench.model, cache_size=slots, budget=budget, mode=_mode(args))
    for variant, measure in (("cache-eager", _eager), ("cache-graphed", _graphed)):
        if variant in wanted:
            rows.append(_row(bench, variant, measure(bench, handle), handle=handle, **label))
    if "cache-ttft" in wanted:
        rows.append(_row(bench, "cache-ttft", _ttft(bench), handle=handle, **label))
    handle.disable()  # after the runner (and its graphs) went with _graphed's frame
    return rows


def _cache_sizes(args) -> list[int]:
    sizes = [_cache_size(args, fraction) for fraction in args.fractions] + list(args.cache_sizes)
    return list(dict.fromkeys(sizes))  # in order, once each


def _accelerate_runs(bench: Bench) -> list[dict]:
    """accelerate's offload at the GPU budget of the smallest cache (last: it keeps its hooks)."""
    from accelerate import dispatch_model, infer_auto_device_map

    args, model = bench.args, bench.model
    slots = _cache_size(args, min(args.fractions))
    non_expert = sum(p.nbytes for p in model.parameters()) - bench.expert_bytes
    budget = non_expert + bench.expert_bytes * slots // args.experts
    model.to("cpu")  # offloaded weights must live in host memory, not stay on the GPU
    torch.cuda.empty_cache()
    device_map = infer_auto_device_map(
        model,
        max_memory={args.device.index or 0: budget, "cpu": 2**40},
        no_split_module_classes=model._no_split_modules,
    )
    dispatch_model(model, device_map=device_map)
    on_gpu = sum(1 for place in device_map.values() if place not in ("cpu", "disk"))
    print(f"accelerate: GPU budget {budget / 1e9:.1f} GB, {on_gpu} of {len(device_map)} device-map entries on the GPU")
    label = {"budget": f"{budget / 1e9:.1f} GB", "slots": ""}
    rows = []
    if "accelerate" in args.variants:
        timed = argparse.Namespace(**{**vars(args), "warmup_tokens": 1, "new_tokens": args.accelerate_new_tokens})
        measured = _measure(dataclasses.replace(bench, args=timed), lambda n: greedy_generate(model, bench.prompt, n))
        rows.append(_row(bench, "accelerate", measured, **label))
    if "accelerate-ttft" in args.variants:
        rows.append(_row(bench, "accelerate-ttft", _ttft(bench), **label))
    return rows


def main() -> None:
    args = _arguments()
    env = environment()
    print(
        f"{env['gpu']}; torch {env['torch']}, triton {env['triton']}, transformers {transformers.__version__}, "
        f"commit {env['commit']}"
    )
    bench = _build(args)
    print(
        f"{args.model} shapes ({args.family}): {args.layers} MoE layers x {args.experts} experts of "
        f"{args.hidden} x {args.intermediate}, top-{args.top_k}, {str(args.dtype).removeprefix('torch.')}; "
        f"experts {bench.expert_bytes / 1e9:.2f} GB; batch {args.batch}, prompt {args.prompt_tokens}, "
        f"{args.new_tokens} new tokens; routing {'the Qwen3-30B-A3B trace' if args.trace else 'the random router'}"
    )
    copy_gbps = pinned_copy_gbps(64 * 2**20) if args.device.type == "cuda" else float("inf")
    print(f"pinned host -> GPU copy engine, 64 MiB: {copy_gbps:.1f} GB/s (the bound's bandwidth)")
    rows = []
    if "resident-eager" in args.variants:
        rows.append(_row(bench, "resident-eager", _eager(bench)))
    if "resident-graphed" in args.variants:
        rows.append(_row(bench, "resident-graphed", _graphed(bench)))
    if "resident-ttft" in args.variants:
        rows.append(_row(bench, "resident-ttft", _ttft(bench)))
    for slots in _cache_sizes(args):
        for budget in args.budgets:
            rows.extend(_cache_runs(bench, slots, budget))
    if any(v.startswith("accelerate") for v in args.variants):  # last: dispatch_model leaves its hooks
        try:
            rows.extend(_accelerate_runs(bench))
        except ImportError as error:
            print(f"accelerate variants skipped: {error}")
    _ratios(rows, copy_gbps)
    _report(args, rows, copy_gbps)


def _report(args, rows: list[dict], copy_gbps: float) -> None:
    for row in rows:
        del row["_step_s"], row["_step_bytes"]
    print_table(rows, COLUMNS, title="tok/s: new tokens / wall time of the timed call (prefill included)")
    print("decode_tok_per_s: (N - 1) tokens / (time of N new tokens - time of 1), prefill excluded; x_resident:")
    print("  the decode step over the resident step of the same runner; x_bound: over that step + the step's")
    print(f"  copied bytes (mb_per_decode_token, the same difference) at {copy_gbps:.1f} GB/s")
    mismatches = [f"{r['variant']} {r['budget']} {r['slots']}".strip() for r in rows if r["same_tokens"] is False]
    unchecked = sum(r["same_tokens"] == "n/a" for r in rows)
    print(f"tokens differ from the resident run's: {', '.join(mismatches)}" if mismatches else "same tokens: all runs")
    if unchecked:
        print(f"({unchecked} runs unchecked: no resident run of their phase in this process)")
    if args.dry_run:
        print("dry run: graphed variants took the eager path (no CUDA), caches host mode; no CSV row written")
        return
    setup = {
        "transformers": transformers.__version__, "model": args.model, "family": args.family,
        "layers": args.layers, "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
        "intermediate": args.intermediate, "dtype": str(args.dtype).removeprefix("torch."),
        "implementation": args.experts_implementation, "batch": args.batch,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "ttft_tokens": args.ttft_tokens, "routing": "qwen3-trace" if args.trace else "router",
        "experts_format": args.experts_format, "copy_gbps": round(copy_gbps, 2),
    }  # fmt: skip
    path = append_csv("bench_generate", [{**setup, **row} for row in rows])
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
