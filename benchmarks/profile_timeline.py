"""Where a profiled decode step's GPU time goes, read from a `torch.profiler` Chrome trace.

`bench_batch.py --profile` replays a captured decode step a few times under the profiler and
keeps the trace (``--profile-dir``). This module reads the trace's GPU events (kernels and
memcpys) and answers two questions:

* ``spans``: per step, how long the copy kernel runs alone, compute runs alone, both run, and
  the GPU sits idle, and what runs while no copy does;
* ``link_gaps``: every interval between two copy kernels (the PCIe link idles, for a cache
  that moves experts with the copy kernel) inside a step, with the admissions run in it: one
  is the chain from a layer's copies to the next layer's (the apply waiting for the last
  copy, the next dense part, router, admission), more are whole layers that had nothing to
  copy. Gaps holding a GPU idle stretch over `BETWEEN_US` are the host's (between replays,
  the profiler's start) and are left out, from `spans` too.

Run on a saved trace, no GPU needed::

    python benchmarks/profile_timeline.py TRACE.json[.gz] [--replays 4]

(`results/profiles/` keeps the traces the README's figures were read from.)
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import dataclass
from pathlib import Path

#: The kernels that move expert bytes over PCIe: raw (`expertcache.kernels.copy_experts`) and
#: exponent-coded (`expertcache.kernels.decode_copy`). Torch's own copy kernels (``copy_`` of
#: inputs) are compute here.
COPY_KERNELS = ("_copy_experts_kernel", "_decode_copy_kernel")
#: The admission kernels (`expertcache.kernels.admission_kernels`: a call's, a prefetch's).
ADMISSION = "_admit"
#: The router's softmax over the chosen logits (`expertcache.decode_stack`): one a layer, so
#: the routers inside a link gap count the layer boundaries it spans.
ROUTER = "softmax"
#: The expert apply kernels (`expertcache.kernels`: the decode GEMV's two halves and the sum
#: over top-k, the grouped GEMM).
APPLY_KERNELS = ("_gate_up_kernel", "_down_kernel", "_sum_over_k_kernel", "_grouped")
#: The host's copies of a replay's inputs into the graph's buffers (``GraphedDecodeStep``).
INPUT_COPY = "Memcpy"
#: A copy kernel shorter than this (us) moved nothing: one expert of the benchmark's shapes
#: (9.4 MB) takes ~200 us over PCIe, an empty launch ~2 us.
EMPTY_COPY_US = 10.0
#: GPU idle stretches longer than this (us) are the host's (between replays, the profiler's
#: start): inside a replayed graph, kernels follow each other within microseconds.
BETWEEN_US = 200.0


@dataclass(frozen=True)
class Event:
    """One GPU event: ``name``, start ``ts`` and ``dur`` in microseconds."""

    name: str
    ts: float
    dur: float

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def copies(self) -> bool:
        """Whether this event moves expert bytes: one of `COPY_KERNELS`, running at least
        `EMPTY_COPY_US` (a layer without misses still launches its copy kernel, which returns
        at once; it counts as compute)."""
        return self.dur >= EMPTY_COPY_US and any(name in self.name for name in COPY_KERNELS)


def load_events(path: str | Path) -> list[Event]:
    """The kernels and memcpys of a Chrome trace (``.json``, or gzip-compressed ``.json.gz``),
    by start time.

    Raises:
        ValueError: not a Chrome trace (no ``traceEvents`` list), or no GPU events in it.
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        data = json.loads(raw.decode())
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable Chrome trace ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return events_of(data["traceEvents"], source=str(path))


def events_of(trace_events: list, *, source: str = "trace") -> list[Event]:
    """The GPU events (``cat`` kernel or gpu_memcpy) of a trace's event list, by start time."""
    events = [
        Event(str(e["name"]), float(e["ts"]), float(e["dur"]))
        for e in trace_events
        if isinstance(e, dict) and e.get("cat") in ("kernel", "gpu_memcpy")
    ]
    if not events:
        raise ValueError(f"{source}: the profiler saw no GPU events")
    return sorted(events, key=lambda event: event.ts)


def spans(
    events: list[Event], replays: int, *, between_us: float = BETWEEN_US
) -> tuple[dict[str, float], dict[str, float]]:
    """Microseconds a step in which only copies, only compute, both, or nothing ran (idle
    stretches over ``between_us`` left out: the host between replays, the profiler's start),
    and the time a step of each kernel (by name, 48 characters) while no copy ran, shared
    among the kernels running together (``"(nothing: ...)"`` for idle time)."""
    edges = sorted({t for e in events for t in (e.ts, e.end)})
    totals = {"copy only": 0.0, "compute only": 0.0, "both": 0.0, "idle": 0.0}
    without_copies: dict[str, float] = {}
    for left, right in zip(edges, edges[1:], strict=False):
        running = [e for e in events if e.ts <= left and e.end >= right]
        if not running and right - left > between_us:
            continue
        copying = any(e.copies for e in running)
        computing = any(not e.copies for e in running)
        kind = "both" if copying and computing else "copy only" if copying else "compute only" if computing else "idle"
        totals[kind] += right - left
        if not copying:
            for name in [e.name[:48] for e in running] or ["(nothing: launch gaps, waits)"]:
                without_copies[name] = without_copies.get(name, 0.0) + (right - left) / max(1, len(running))
    return ({k: v / replays for k, v in totals.items()}, {k: v / replays for k, v in without_copies.items()})


@dataclass(frozen=True)
class LinkGap:
    """An interval between two copies (microseconds) and the routers run in it: 0, a gap
    inside one layer's copies; 1, the chain from one layer's copies to the next layer's
    (the apply waiting for the last copy, the next dense part, router and admission); ``n``
    over 1, ``n - 1`` whole layers computed with nothing to copy. ``tail_us``: from the gap's
    start to the end of the last expert apply kernel that started before its first
    admission (the apply waiting for the last copy); ``admission_us``: the admissions' run
    time inside the gap. ``step_boundary``: the gap holds the host's input copies of the next
    replay (``Memcpy`` events), so it spans the end of one step and the start of the next."""

    us: float
    routers: int
    step_boundary: bool = False
    tail_us: float = 0.0
    admission_us: float = 0.0

    @property
    def dense_us(self) -> float:
        """What is neither the apply tail nor an admission: the dense parts and routers (and
        launch gaps between kernels)."""
        return self.us - self.tail_us - self.admission_us


def link_gaps(events: list[Event], *, between_us: float = BETWEEN_US) -> tuple[list[LinkGap], float]:
    """The gaps between copy kernels (their union) inside steps, and the microseconds of the
    gaps left out: those holding an idle stretch over ``between_us`` (the host between
    replays), and the time before the first copy and after the last.

    Raises:
        ValueError: no copy kernel in ``events``.
    """
    copies = sorted((e.ts, e.end) for e in events if e.copies)
    if not copies:
        raise ValueError(f"no copy kernel ({', '.join(COPY_KERNELS)}) in the profile: nothing moved experts")
    busy: list[list[float]] = []
    for start, end in copies:
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    gaps, left_out = [], busy[0][0] - events[0].ts + max(e.end for e in events) - busy[-1][1]
    for (_, left), (right, _) in zip(busy, busy[1:], strict=False):
        inside = [e for e in events if e.end > left and e.ts < right and not e.copies]
        if _longest_idle(inside, left, right) > between_us:
            left_out += right - left
        else:
            gaps.append(_gap(inside, left, right))
    return gaps, left_out


def _gap(inside: list[Event], left: float, right: float) -> LinkGap:
    admissions = [e for e in inside if ADMISSION in e.name]
    first_admission = min((e.ts for e in admissions), default=right)
    applies = [e.end for e in inside if e.ts < first_admission and any(name in e.name for name in APPLY_KERNELS)]
    tail = max(0.0, min(max(applies, default=left), first_admission) - left)
    admitting = sum(max(0.0, min(e.end, right) - max(e.ts, left)) for e in admissions)
    boundary = any(INPUT_COPY in e.name for e in inside)
    routers = sum(ROUTER in e.name for e in inside)
    return LinkGap(right - left, routers, tail_us=tail, admission_us=admitting, step_boundary=boundary)


def _longest_idle(inside: list[Event], left: float, right: float) -> float:
    """The longest stretch of ``[left, right]`` that no event of ``inside`` covers."""
    longest, reached = 0.0, left
    for event in sorted(inside, key=lambda e: e.ts):
        longest = max(longest, event.ts - reached)
        reached = max(reached, event.end)
    return max(longest, right - reached)


def report(events: list[Event], replays: int) -> str:
    """The text `bench_batch.py --profile` prints for one variant's replays."""
    totals, without_copies = spans(events, replays)
    by_name: dict[str, float] = {}
    for event in events:
        by_name[event.name[:48]] = by_name.get(event.name[:48], 0.0) + event.dur / replays
    lines = [", ".join(f"{k} {v / 1e3:.3f}" for k, v in totals.items()) + " ms a step (the host's gaps left out)"]
    lines += [f"  {us:9.1f} us  {name}" for name, us in sorted(by_name.items(), key=lambda item: -item[1])[:12]]
    lines.append(f"  while no copy runs ({sum(without_copies.values()) / 1e3:.3f} ms a step):")
    lines += [f"  {us:9.1f} us  {name}" for name, us in sorted(without_copies.items(), key=lambda item: -item[1])[:10]]
    if any(event.copies for event in events):
        gaps, _ = link_gaps(events)
        ends = [g for g in gaps if g.step_boundary and g.routers <= 1]  # last layer's tail, next step's layer 0
        inside = [g for g in gaps if g not in ends]
        chain = "to the next layer's copies (apply tail, dense, router, admission)"
        kinds = (
            ("inside a layer's copies", [g for g in inside if g.routers == 0]),
            (chain, [g for g in inside if g.routers == 1]),
            ("across layers with nothing to copy", [g for g in inside if g.routers > 1]),
            ("across a step's end (the last apply, the next replay's inputs, its first router)", ends),
        )
        lines.append("  the link idles between copies (no copy kernel runs), a step:")
        for label, chosen in kinds:
            text = f"    {label}: {len(chosen) / replays:.1f} gaps, {sum(g.us for g in chosen) / replays / 1e3:.3f} ms"
            if chosen:
                text += f" (median {sorted(g.us for g in chosen)[len(chosen) // 2]:.1f} us"
                skipped = sum(g.routers - 1 for g in chosen)
                crossing = sum(g.step_boundary for g in chosen)
                text += (
                    f", {skipped / replays:.1f} layers, {crossing} across a step's end)"
                    if label.startswith("across layers")
                    else ")"
                )
            lines.append(text)
            if chosen and label == chain:
                parts = {
                    "apply tail": [g.tail_us for g in chosen],
                    "dense parts and router": [g.dense_us for g in chosen],
                    "admission": [g.admission_us for g in chosen],
                }
                lines.append(
                    "      medians: " + ", ".join(f"{k} {sorted(v)[len(v) // 2]:.1f} us" for k, v in parts.items())
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a Chrome trace of bench_batch.py --profile --profile-dir")
    parser.add_argument("--replays", type=int, default=4, help="graph replays in the trace (bench_batch's 4)")
    args = parser.parse_args(argv)
    if args.replays < 1:
        parser.error(f"--replays must be at least 1, got {args.replays}")
    try:
        events = load_events(args.trace)
    except ValueError as err:
        parser.exit(2, f"profile_timeline.py: error: {err}\n")
    print(f"{args.trace}: {len(events)} GPU events, {args.replays} replays")
    print(report(events, args.replays))
    return 0


if __name__ == "__main__":
    sys.exit(main())
