"""What `expertcache.planner.plan` checks of its arguments before it replays anything.

Each check takes one argument (or the few that must agree), raises TypeError or ValueError
naming it, and returns it in the form the planner computes with: Python ints (numpy's
integers too: `expertcache.validation.check_int`), floats, distinct lower-case policy names.
A number must be finite and real (never a bool); the runtime policies are `RUNTIME_POLICIES`
(Belady and the unbounded cache are the bounds, always scored beside them).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence

from expertcache.manifest import MAX_EXPERT_BYTES
from expertcache.trace import RoutingTrace
from expertcache.validation import check_int

#: Policies a runtime cache can use (Belady is the bound, not a choice).
RUNTIME_POLICIES = ("lru", "lfu", "slru", "arc", "lfru", "least_stale", "gdsf")


def check_policies(policies: Sequence[str]) -> tuple[str, ...]:
    """``policies`` as distinct lower-case runtime policy names (at least one).

    Raises:
        TypeError: not a sequence of str. ValueError: empty, unknown, repeated, or a bound
            (``belady``, ``unbounded``: always scored beside them).
    """
    if isinstance(policies, str) or not isinstance(policies, Iterable):
        raise TypeError(f"policies must be a sequence of policy names, got {policies!r:.60}")
    policies = tuple(policies)  # read once: a generator has nothing left the second time
    if not all(isinstance(name, str) for name in policies):
        raise TypeError(f"policies must be a sequence of policy names, got {policies!r:.60}")
    names = tuple(name.strip().lower() for name in policies)
    known = ", ".join(RUNTIME_POLICIES)
    if not names:
        raise ValueError(f"no policy to score; runtime policies: {known}")
    for name in names:
        if name in ("belady", "unbounded"):
            raise ValueError(f"{name!r} is a bound, always scored beside the policies; list runtime policies: {known}")
        if name not in RUNTIME_POLICIES:
            raise ValueError(f"unknown runtime policy {name!r}; runtime policies: {known}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"policies repeat {', '.join(repeated)}")
    return names


def check_plan_arguments(
    trace: RoutingTrace, expert_bytes: int, budget: int, bandwidth: float | None, model_layers: int | None
) -> tuple[int, int, int | None]:
    """``(expert_bytes, budget, model_layers)`` as Python ints, after checking every argument."""
    if not isinstance(trace, RoutingTrace):
        raise TypeError(f"trace must be a RoutingTrace, got {type(trace).__name__}")
    if trace.num_records == 0:
        source = f" ({trace.source})" if trace.source else ""
        raise ValueError(f"the trace{source} has no routing records ({trace.num_tokens} tokens): nothing to plan on")
    expert_bytes = _check_count("expert_bytes", expert_bytes, minimum=1)
    if expert_bytes > MAX_EXPERT_BYTES:
        raise ValueError(f"expert_bytes must be at most {MAX_EXPERT_BYTES:,} (MAX_EXPERT_BYTES), got {expert_bytes:,}")
    if trace.top_k > trace.num_experts:
        raise ValueError(f"the trace routes each token to {trace.top_k} of {trace.num_experts} experts: no cache fits")
    budget = _check_count("gpu_budget_bytes", budget, minimum=0)
    if model_layers is not None:
        why = f"the trace records {trace.num_layers}"
        model_layers = _check_count("model_layers", model_layers, minimum=trace.num_layers, why=why)
    if bandwidth is not None and not (_finite_number(bandwidth) and bandwidth > 0):
        raise ValueError(f"bandwidth_bytes_per_second must be a positive finite number or None, got {bandwidth!r:.40}")
    return expert_bytes, budget, model_layers


def check_copy_bytes(copy_bytes: int, expert_bytes: int) -> int:
    """``copy_bytes`` as a Python int in ``[1, expert_bytes]``: a coded record is never larger."""
    copy_bytes = _check_count("copy_bytes", copy_bytes, minimum=1)
    if copy_bytes > expert_bytes:
        raise ValueError(f"copy_bytes ({copy_bytes}) must be at most expert_bytes ({expert_bytes}): "
                         "a coded record is never larger than the raw one")  # fmt: skip
    return copy_bytes


def check_fractions(fractions: Sequence[float]) -> tuple[float, ...]:
    """``fractions`` as floats, each in ``(0, 1]`` (an empty sequence too)."""
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, Iterable):
        raise TypeError(f"fractions must be a sequence of numbers, got {fractions!r:.40}")
    values = tuple(fractions)
    for fraction in values:
        if not (_finite_number(fraction) and 0 < fraction <= 1):
            raise ValueError(f"fractions must be numbers in (0, 1], got {fraction!r:.40}")
    return tuple(float(fraction) for fraction in values)


def check_progress(progress: Callable[[int], Callable[[], None]] | None) -> None:
    """Refuse a ``progress`` that is neither None nor callable."""
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable progress(total) -> tick, or None; got {type(progress).__name__}")


def check_min_gain(min_gain: float) -> None:
    """Refuse a ``min_gain`` that is not a finite number >= 0."""
    if not (_finite_number(min_gain) and min_gain >= 0):
        raise ValueError(f"min_gain must be a non-negative number, got {min_gain!r:.40}")


def _finite_number(value: object) -> bool:
    """A finite real number of any type (numpy's too), never a bool, and within a float's range."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float (10**400): no rate, gain or fraction is that large
        return False


def _check_count(name: str, value: object, *, minimum: int, why: str = "") -> int:
    """``value`` as a Python int (any integer, numpy's too: `check_int`) of at least ``minimum``."""
    number = check_int(name, value)
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum}{' (' + why + ')' if why else ''}, got {number}")
    return number
