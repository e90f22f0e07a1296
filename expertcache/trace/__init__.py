"""Routing traces: one format (`RoutingTrace`) and loaders for every known source format."""

from expertcache.trace.format import RoutingTrace
from expertcache.trace.loaders import detect_format, load_trace

__all__ = ["RoutingTrace", "detect_format", "load_trace"]
