"""``expertcache plan``: which cache size and policy a GPU budget buys, scored on a trace.

    expertcache plan --trace FILE|DIR (--expert-bytes B | --manifest FILE) --gpu-budget GB
                     [--bandwidth GBps] [--layers N] [--num-experts E] [--policies lru,arc,...]
                     [--plot FILE.png] [--csv FILE] [--no-progress]
                     [--compression exponent [--compression-ratio R]] [--overlapped-passes]

``--trace`` takes a RoutingTrace ``.npz``, any ``shared/traces`` routing file, or a folder
whose routing files share one format (see `expertcache.trace.load_trace`). GB here are 1e9
bytes.

Nothing is written until the plan is made: ``--csv`` and ``--plot`` are checked before the
trace is read (writable, neither the other nor an input file) and rendered in memory, then
written. ``--manifest`` must describe the trace's model (its experts per layer); the
recommended cache size is one the runtime takes (at least the trace's top-k).

The budget is split over the model's MoE layers and per-token costs are scaled to them (the
traced layers taken as representative; see `model_layers`): ``--layers N``, else the layers
of a manifest of several (written from every cached layer of the model), else the trace's.
A manifest of one layer (``provider.manifest().write(FILE)``) gives the expert sizes only. A
manifest of several layers that covers fewer than the trace records, or that ``--layers``
contradicts, is refused. When the manifest's layers are more than the trace's, the output
says so in one line; the CSV records ``traced_layers`` and ``model_layers`` on every row.

``--compression exponent`` costs each miss at the coded bytes of an exponent-coded store
(``--moe-expert-cache-compression exponent``); the slots, and so the cache size a budget
buys, stay raw. The bytes per miss come from, in this order: ``--compression-ratio R``
(R x expert bytes); the manifest's ``compressed_expert_bytes`` when it was written from an
exponent-coded cache (measured on the model's own experts: the figure to trust); else
`DEFAULT_EXPONENT_RATIO` x expert bytes, stated in the output.

A call that routes to more experts than a pool's share (a prefill, a batch of requests) is
replayed in expert-group passes, as ``provider.passes(ids)`` serves it (the transformers
integration); ``--overlapped-passes`` replays it as `expertcache.decode_stack.DecodeStack`
serves it: in overlapped passes (``passes(ids, overlap=True)``: groups of half the share)
when the call has at most `expertcache.passes.OVERLAP_MAX_IDS` (1,024) ids, else (a long
prefill) in passes one after the other.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import math
import sys
from collections.abc import Callable
from pathlib import Path

from expertcache.commands.arguments import MAX_COUNT, input_path, output_file, positive_number, whole_number
from expertcache.commands.files import check_distinct
from expertcache.config import COMPRESSION_CHOICES
from expertcache.file_writes import write_files
from expertcache.manifest import MAX_EXPERT_BYTES
from expertcache.passes import OVERLAP_MAX_IDS
from expertcache.planner import RUNTIME_POLICIES, Plan, PlanRow, check_policies

#: The largest --gpu-budget (GB) and --bandwidth (GB/s) taken: an exabyte, an exabyte a second.
MAX_GIGABYTES = 1e9

#: Coded / raw bytes of an exponent-coded bf16 expert when nothing better is known: the top
#: of what ``benchmarks/compression_ratio.py`` and ``bench_compression.py`` measure on
#: normal-initialised bf16 weights and the random families' experts with the default code
#: (0.68-0.69). Trained weights, and fp16 (~0.87: its exponent is 5 bits), differ: measure
#: with a manifest.
DEFAULT_EXPONENT_RATIO = 0.69


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="score policies x cache sizes on a routing trace; recommend a cache size"
    )
    parser.add_argument("--trace", required=True, type=input_path, help="routing trace (.npz, .jsonl or folder)")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--expert-bytes", type=whole_number(1, MAX_EXPERT_BYTES), help="bytes of one expert (record)")
    size.add_argument(
        "--manifest",
        type=input_path,
        help="manifest JSON: expert sizes (one layer's: provider.manifest().write(FILE)) and, written from "
        "every cached layer of the model, its MoE layers (the budget is split over them)",
    )
    gigabytes = positive_number(MAX_GIGABYTES)
    parser.add_argument("--gpu-budget", type=gigabytes, required=True, help="GB for slots")
    parser.add_argument("--bandwidth", type=gigabytes, help="host->GPU copy GB/s")
    parser.add_argument(
        "--layers",
        type=whole_number(1, MAX_COUNT),
        help="MoE layers of the model (default: a manifest's of several layers, else the trace's)",
    )
    parser.add_argument("--num-experts", type=whole_number(1, MAX_COUNT), help="experts per layer (override)")
    parser.add_argument(
        "--policies",
        type=_policy_list,
        default=RUNTIME_POLICIES,
        help=f"comma-separated runtime policy names (default: {','.join(RUNTIME_POLICIES)})",
    )
    parser.add_argument("--plot", type=output_file(".png"), help="write hit rate vs cache size to this PNG")
    parser.add_argument("--csv", type=output_file(), help="write every scored row to this CSV")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--compression",
        choices=COMPRESSION_CHOICES,
        default="none",
        help="exponent: cost each miss at an exponent-coded store's bytes (the manifest's measured "
        f"figure, --compression-ratio, else {DEFAULT_EXPONENT_RATIO} x expert bytes) (default: none)",
    )
    parser.add_argument(
        "--compression-ratio",
        type=positive_number(1.0),
        help="coded / raw bytes of one expert, in (0, 1]; with --compression exponent",
    )
    parser.add_argument(
        "--overlapped-passes",
        action="store_true",
        help=f"replay calls that do not fit as DecodeStack serves them: overlapped passes (passes(ids, "
        f"overlap=True)) for calls of at most {OVERLAP_MAX_IDS:,} ids, passes one after the other above",
    )
    parser.set_defaults(func=run)


def _policy_list(text: str) -> tuple[str, ...]:
    try:
        return check_policies([name for name in text.split(",") if name.strip()])
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    from expertcache.planner import plan
    from expertcache.trace import load_trace, trace_files

    if args.compression_ratio is not None and args.compression != "exponent":
        raise ValueError("--compression-ratio applies with --compression exponent")
    outputs = {flag: path for flag, path in (("--csv", args.csv), ("--plot", args.plot)) if path is not None}
    inputs = {"--trace": trace_files(args.trace), "--manifest": [args.manifest] if args.manifest else []}
    check_distinct(outputs, inputs)
    manifest = read_manifest_sizes(args.manifest) if args.manifest else None
    coded = read_manifest_copy_bytes(args.manifest) if args.manifest else None
    trace = load_trace(args.trace, num_experts=args.num_experts)
    if trace.num_records == 0:
        raise ValueError(
            f"{args.trace}: the trace has no routing records ({trace.num_tokens} tokens): nothing to plan on"
        )
    layers, layers_note = model_layers(trace.num_layers, args.layers, args.manifest)
    expert_bytes = args.expert_bytes
    if manifest is not None:
        expert_bytes, per_layer = manifest
        if per_layer != trace.num_experts:
            raise ValueError(
                f"--manifest {args.manifest} has {per_layer} experts per layer, the trace {trace.num_experts}: "
                "the plan would be for another model (a trace that does not state its experts counts to its "
                "largest id: --num-experts sets it)"
            )
    copy_bytes, copy_source = bytes_per_miss(args.compression, args.compression_ratio, expert_bytes, coded)
    if coded is not None and args.compression != "exponent":
        print(f"note: the manifest's store is exponent-coded ({coded:,} bytes a miss); "
              "add --compression exponent to cost misses at them")  # fmt: skip
    policies = list(args.policies)
    result = plan(
        trace,
        expert_bytes=expert_bytes,
        gpu_budget_bytes=round(args.gpu_budget * 1e9),
        bandwidth_bytes_per_second=args.bandwidth * 1e9 if args.bandwidth else None,
        model_layers=layers,
        policies=policies,
        progress=None if args.no_progress else _progress_bar,
        copy_bytes=copy_bytes,
        oversize="overlapped" if args.overlapped_passes else "passes",
        overlap_max_ids=OVERLAP_MAX_IDS if args.overlapped_passes else None,
    )
    print(_describe(trace, expert_bytes, layers, args))
    if layers_note:
        print(layers_note)
    if copy_source:
        print(f"bytes per miss {copy_bytes:,} ({copy_bytes / expert_bytes:.3f} of the expert bytes, {copy_source})")
    print(format_table(result, policies))
    print(recommendation(result, trace.num_experts, layers))
    # rendered first, then written together: a plot or a write that fails leaves no CSV behind
    columns = {"traced_layers": trace.num_layers, "model_layers": layers}
    name = trace.model or args.trace.name
    write_files({path: _render(flag, result, name, columns) for flag, path in outputs.items()})
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def read_manifest_sizes(path: str | Path) -> tuple[int, int]:
    """``(expert_bytes, experts per layer)`` from a manifest written by ``Manifest.write``.

    Raises:
        ValueError: anything `Manifest.read` refuses, or experts that do not split evenly
            over the layers (the message names the file).
    """
    from expertcache.manifest import Manifest

    try:
        manifest = Manifest.read(path)
    except ValueError as error:
        raise ValueError(f"--manifest {error}") from None
    if manifest.experts % manifest.layers:
        raise ValueError(
            f"--manifest {path}: {manifest.experts} experts do not split evenly over {manifest.layers} layers"
        )
    return manifest.expert_bytes, manifest.experts // manifest.layers


def model_layers(traced: int, layers: int | None, manifest: str | Path | None) -> tuple[int, str]:
    """``(MoE layers of the model, a line saying they come from the manifest or "")``.

    The budget is split over these layers and per-token costs are scaled to them
    (`expertcache.planner.plan`'s ``model_layers``): ``--layers`` when given; else the layers
    of a manifest covering several (`expertcache.manifest.build_manifest` of every cached
    layer: the model's); else the trace's. A manifest of one layer (``provider.manifest()``)
    gives the expert sizes only.

    Args:
        traced: the layers the trace records.
        layers: ``--layers`` (None: not given).
        manifest: ``--manifest`` (None: not given), already checked by `read_manifest_sizes`.

    Raises:
        ValueError: ``--layers``, or a manifest of several layers, below ``traced``; or
            ``--layers`` and such a manifest disagreeing.
    """
    from expertcache.manifest import Manifest

    if layers is not None and layers < traced:
        raise ValueError(f"--layers {layers} is fewer than the {traced} MoE layers the trace records")
    covered = Manifest.read(manifest).layers if manifest is not None else 1
    if covered == 1:  # no manifest, or one layer's: it says nothing of the model's layers
        return layers or traced, ""
    if covered < traced:
        raise ValueError(
            f"--manifest {manifest} covers {covered} MoE layers, fewer than the {traced} the trace records: the "
            "plan would be for another model (a manifest of one layer, provider.manifest(), gives expert sizes only)"
        )
    if layers is not None and layers != covered:
        raise ValueError(f"--layers {layers} disagrees with --manifest {manifest}, which covers {covered} MoE layers")
    if covered == traced:
        return covered, ""
    return covered, (
        f"model layers {covered} (from --manifest {manifest}; the trace records {traced}): the GPU budget is split "
        f"over all {covered}, per-token costs scaled up from the traced layers"
    )


def read_manifest_copy_bytes(path: str | Path) -> int | None:
    """The bytes one miss reads from an exponent-coded store the manifest describes (its
    ``compressed_expert_bytes``); None when the manifest's store is raw."""
    from expertcache.manifest import Manifest

    manifest = Manifest.read(path)  # read_manifest_sizes has already checked it
    if manifest.compression != "exponent" or manifest.compressed_expert_bytes is None:
        return None
    return manifest.compressed_expert_bytes


def bytes_per_miss(compression: str, ratio: float | None, expert_bytes: int, measured: int | None) -> tuple[int, str]:
    """``(bytes one miss moves host -> GPU, where the figure comes from)``; ``""`` when raw.

    Args:
        compression: ``"none"`` or ``"exponent"``.
        ratio: ``--compression-ratio`` (None: not given).
        expert_bytes: raw bytes of one expert (what a slot holds).
        measured: an exponent-coded manifest's ``compressed_expert_bytes`` (None: none).
    """
    if compression != "exponent":
        return expert_bytes, ""
    if ratio is not None:
        return math.ceil(expert_bytes * ratio), f"exponent-coded, --compression-ratio {ratio:g}"
    if measured is not None:
        return measured, "exponent-coded, measured on the model's experts (manifest)"
    return (
        math.ceil(expert_bytes * DEFAULT_EXPONENT_RATIO),
        f"exponent-coded, default ratio {DEFAULT_EXPONENT_RATIO} of normal bf16 weights; a manifest measures yours",
    )


def _progress_bar(total: int) -> Callable[[], None]:
    from tqdm import tqdm

    # disable=None: shown on a terminal, silent when stderr is a file or a pipe
    bar = tqdm(total=total, desc="replaying", unit="run", file=sys.stderr, leave=False, disable=None)
    return lambda: bar.update(1)


def _describe(trace, expert_bytes: int, layers: int, args: argparse.Namespace) -> str:
    lines = [
        f"trace: {args.trace}",
        f"  {trace.model or 'model not recorded'}: {trace.num_tokens} tokens, "
        f"{trace.num_forwards} forward passes, {trace.num_layers} layer(s) traced of {layers}, "
        f"{trace.num_experts} experts, top-{trace.top_k}",
        f"  notes: {trace.notes}" if trace.notes else "",
        f"expert bytes {expert_bytes:,}; GPU budget {args.gpu_budget:g} GB"
        + (f"; copy bandwidth {args.bandwidth:g} GB/s" if args.bandwidth else ""),
        "calls that do not fit: "
        + (
            f"overlapped passes up to {OVERLAP_MAX_IDS:,} ids a call, one after the other above (as DecodeStack)"
            if args.overlapped_passes
            else "passes one after the other"
        ),
    ]
    return "\n".join(line for line in lines if line)


def format_table(result: Plan, policies: list[str]) -> str:
    """Hit rates per policy by pool and size, then Belady, unbounded, and the best's costs."""
    header = (
        f"{'pool':<7}{'slots':>6}{'%exp':>6} "
        + "".join(f"{name:>12}" for name in policies)
        + f"{'belady':>9}{'unbnd':>7}  {'best':<11}{'miss/tok':>9}{'GB/tok':>8}{'tok/s':>9}"
    )
    lines = ["hit rate (%) by policy; costs of the best runtime policy", header, "-" * len(header)]
    keys = dict.fromkeys((row.scope, row.slots) for row in result.rows)
    for scope, slots in keys:
        cells = {name: result.row(scope, slots, name) for name in (*policies, "belady", "unbounded")}
        best = max((cells[name] for name in policies), key=lambda row: row.hit_rate)
        budget = result.layer_cache_size if scope == "layer" else result.global_slots
        marker = "*" if slots == budget else " "
        lines.append(
            f"{scope:<7}{slots:>6}{best.fraction * 100:>5.0f}{marker}"
            + "".join(f"{cells[name].hit_rate * 100:>12.1f}" for name in policies)
            + f"{cells['belady'].hit_rate * 100:>9.1f}{cells['unbounded'].hit_rate * 100:>7.1f}  "
            f"{best.policy:<11}{best.misses_per_token:>9.2f}{best.gb_per_token:>8.3f}"
            + (f"{best.tokens_per_second:>9.1f}" if best.tokens_per_second is not None else f"{'-':>9}")
        )
    lines.append("* = the GPU budget's size")
    return "\n".join(lines)


def recommendation(result: Plan, num_experts: int, layers: int) -> str:
    """What to run with, in one paragraph."""
    if result.layer_cache_size < result.min_cache_size:
        return (
            f"The budget buys {result.budget_slots} expert slots, {result.layer_cache_size} per layer "
            f"({layers} layers): fewer than the {result.min_cache_size} a cache needs (the router's top-k, "
            "the smallest --moe-expert-cache-size): raise --gpu-budget."
        )
    layer = result.row("layer", result.layer_cache_size, result.layer_policy)
    pool = result.row("global", result.global_slots, result.global_policy)
    bound = result.row("layer", result.layer_cache_size, "belady")
    warning = ""
    if layer.split_calls:
        warning = (
            f"\n  note: {layer.split_calls} calls of the trace need more distinct experts than "
            f"{result.layer_cache_size} slots; they run in expert-group passes (counted as the "
            "runtime copies them), each pass reloading what the last one evicted."
        )
    return (
        f"recommendation: --moe-expert-cache-size {result.layer_cache_size} "
        f"(of {num_experts} experts per layer, {result.budget_fraction:.0%}) with policy "
        f"'{result.layer_policy}': hit rate {layer.hit_rate:.1%} (Belady {bound.hit_rate:.1%}), "
        f"{layer.misses_per_token:.2f} misses and {layer.gb_per_token:.3f} GB per token.\n"
        f"  one global pool of the same bytes ({result.global_slots} slots over the traced "
        f"layers) with '{result.global_policy}': hit rate {pool.hit_rate:.1%}." + warning
    )


def _render(flag: str, result: Plan, name: str, columns: dict[str, int]) -> bytes:
    """The bytes of the ``--csv`` (each row with ``columns`` after its fields) or ``--plot`` file."""
    if flag == "--plot":
        from expertcache.plan_plot import render_plan

        return render_plan(result, title=f"{name}: hit rate vs cache size")
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=[field.name for field in dataclasses.fields(PlanRow)] + list(columns))
    writer.writeheader()
    writer.writerows({**dataclasses.asdict(row), **columns} for row in result.rows)
    return text.getvalue().encode("utf-8")
