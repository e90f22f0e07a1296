"""Trace simulation: replay calls through the runtime's own `SlotTable` and policies.

``replay`` admits each call exactly as a `SlotPool` does (same table, same policy
objects), so a hit rate measured here is the hit rate the runtime cache would see on the
same routing. ``trace_calls`` turns a `RoutingTrace` into calls for a per-layer or a
global pool (warning, `ApproximateReplayWarning`, where a global pool's counts are only
approximate for the trace).
"""

from expertcache.sim.replay import ReplayResult, replay
from expertcache.sim.trace_calls import (
    ApproximateReplayWarning,
    TraceCalls,
    replay_streams,
    replay_trace,
    trace_calls,
    unbounded,
)

__all__ = [
    "ApproximateReplayWarning",
    "ReplayResult",
    "TraceCalls",
    "replay",
    "replay_streams",
    "replay_trace",
    "trace_calls",
    "unbounded",
]
