"""Routing traces: one format for recorded and loaded expert routing (see `format`)."""

from expertcache.trace.format import RoutingTrace

__all__ = ["RoutingTrace"]
