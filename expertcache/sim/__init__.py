"""Trace simulation: replay calls through the runtime's own `SlotTable` and policies.

``replay`` admits each call exactly as a `SlotPool` does (same table, same policy
objects), so a hit rate measured here is the hit rate the runtime cache would see on the
same routing. ``trace_calls`` turns a `RoutingTrace` into calls for a per-layer or a
global pool.
"""

from expertcache.sim.replay import ReplayResult, replay
from expertcache.sim.trace_calls import (
    TraceCalls,
    replay_streams,
    replay_trace,
    trace_calls,
    unbounded,
)

__all__ = [
    "ReplayResult",
    "TraceCalls",
    "replay",
    "replay_streams",
    "replay_trace",
    "trace_calls",
    "unbounded",
]
