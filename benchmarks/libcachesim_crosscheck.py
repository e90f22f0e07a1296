"""Cross-check: LRU and ARC hit counts of `expertcache.sim` against libCacheSim.

libCacheSim (PyPI ``libcachesim``) simulates one request at a time, so both sides get the
same request stream: each call's distinct keys in first-appearance order, one request per
key, unit sizes, capacity in keys. Ours replays that stream as one-key calls. A second
column shows our per-call semantics on the same trace (a call's keys are admitted
together and none of them may be evicted by another), which a one-request-at-a-time
simulator cannot express: that is where the two may legitimately differ.

Run: ``python benchmarks/libcachesim_crosscheck.py`` (CPU only; writes
``benchmarks/results/libcachesim_crosscheck.txt``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import libcachesim

from expertcache.sim import replay, trace_calls

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_set import load_all  # noqa: E402

OURS_TO_THEIRS = {"lru": libcachesim.LRU, "arc": libcachesim.ARC}


def libcachesim_hits(policy: str, keys: list[int], capacity: int) -> int:
    """Hits of libCacheSim's ``policy`` on ``keys`` (unit-size objects, ids shifted by 1)."""
    cache = OURS_TO_THEIRS[policy](cache_size=capacity)
    return sum(bool(cache.get(libcachesim.Request(obj_size=1, obj_id=key + 1))) for key in keys)


def compare(streams, policy: str, capacity: int) -> tuple[int, int, int]:
    """(ours on the flattened stream, libCacheSim's, ours with per-call semantics)."""
    ours = theirs = per_call = 0
    for stream in streams:
        keys = [key for call in stream.calls for key in call]
        ours += replay([[key] for key in keys], policy=policy, capacity=capacity).hits
        theirs += libcachesim_hits(policy, keys, capacity)
        per_call += replay(stream.calls, policy=policy, capacity=capacity, forward_starts=stream.forward_starts).hits
    return ours, theirs, per_call


def main() -> int:
    lines = [
        f"libcachesim {libcachesim.__version__ if hasattr(libcachesim, '__version__') else '?'}",
        f"{'trace':<34} {'pool':<7} {'slots':>6} {'policy':<6} {'ours':>8} {'libCacheSim':>11} "
        f"{'equal':>5} {'per-call':>8}",
    ]
    mismatches = 0
    for label, trace in load_all():
        for scope in ("layer", "global"):
            streams = trace_calls(trace, scope=scope)
            for fraction in (0.25, 0.5):
                capacity = max(1, int(streams[0].num_keys * fraction))
                for policy in OURS_TO_THEIRS:
                    ours, theirs, per_call = compare(streams, policy, capacity)
                    mismatches += ours != theirs
                    lines.append(
                        f"{label:<34} {scope:<7} {capacity:>6} {policy:<6} {ours:>8} "
                        f"{theirs:>11} {'yes' if ours == theirs else 'NO':>5} {per_call:>8}"
                    )
    lines.append(f"mismatches: {mismatches}")
    text = "\n".join(lines)
    print(text)
    out = Path(__file__).resolve().parent / "results" / "libcachesim_crosscheck.txt"
    out.write_text(text + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
