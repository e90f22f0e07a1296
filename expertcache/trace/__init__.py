"""Routing traces: one format for recorded and loaded expert routing (see `format`).

`RoutingRecorder` captures the router's choices of a running model into that format.
"""

from expertcache.trace.format import RoutingTrace
from expertcache.trace.recorder import RoutingRecorder

__all__ = ["RoutingRecorder", "RoutingTrace"]
