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
import sys
from collections.abc import Callable

from expertcache.commands.arguments import MAX_COUNT, input_path, output_file, positive_number, whole_number
from expertcache.commands.files import check_distinct
from expertcache.commands.plan_costs import (
    DEFAULT_EXPONENT_RATIO,
    bytes_per_miss,
    model_layers,
    read_manifest_copy_bytes,
    read_manifest_sizes,
)
from expertcache.commands.plan_report import describe, format_table, recommendation, render
from expertcache.config import COMPRESSION_CHOICES
from expertcache.file_writes import write_files
from expertcache.manifest import MAX_EXPERT_BYTES
from expertcache.passes import OVERLAP_MAX_IDS
from expertcache.planner import RUNTIME_POLICIES, check_policies

#: The largest --gpu-budget (GB) and --bandwidth (GB/s) taken: an exabyte, an exabyte a second.
MAX_GIGABYTES = 1e9


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
    # rendered first, then written together: a plot or a write that fails leaves no CSV behind;
    # written before anything is printed: a reader of the output that goes away (| head) stops
    # the printing, not the files
    columns = {"traced_layers": trace.num_layers, "model_layers": layers}
    name = trace.model or args.trace.name
    write_files({path: render(flag, result, name, columns) for flag, path in outputs.items()})
    print(describe(trace, expert_bytes, layers, args))
    if layers_note:
        print(layers_note)
    if copy_source:
        print(f"bytes per miss {copy_bytes:,} ({copy_bytes / expert_bytes:.3f} of the expert bytes, {copy_source})")
    print(format_table(result, policies))
    print(recommendation(result, trace.num_experts, layers))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _progress_bar(total: int) -> Callable[[], None]:
    from tqdm import tqdm

    # disable=None: shown on a terminal, silent when stderr is a file or a pipe
    bar = tqdm(total=total, desc="replaying", unit="run", file=sys.stderr, leave=False, disable=None)
    return lambda: bar.update(1)
