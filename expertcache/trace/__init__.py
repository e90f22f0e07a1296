"""Routing traces: one format (`RoutingTrace`), loaders for every known source format, and
`RoutingRecorder`, which captures the router's choices of a running model into that format.
"""

from expertcache.trace.format import RoutingTrace
from expertcache.trace.loaders import detect_format, load_trace, trace_files
from expertcache.trace.recorder import RoutingRecorder

__all__ = ["RoutingRecorder", "RoutingTrace", "detect_format", "load_trace", "trace_files"]
