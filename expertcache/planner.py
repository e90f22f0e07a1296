"""Capacity planning: score policies x cache sizes on a routing trace, recommend a size.

For each pool kind (a pool per layer, or one global pool for all layers) and each cache
size, every policy replays the trace through the runtime's own admission
(`expertcache.sim`); Belady's MIN gives the bound at that size and an unbounded cache the
bound at any size. Costs follow from the misses: every miss copies one expert record
(``expert_bytes``; ``copy_bytes`` when the store is compressed: a slot still holds the raw
bytes, PCIe carries the coded ones) host -> GPU, so a copy bandwidth turns bytes per token
into a ceiling on tokens per second (copies alone, compute free).

Per-token figures are over the layers the trace records, scaled to ``model_layers`` when
the model has more (the traced layers are then assumed representative). Only cache sizes a
runtime cache accepts are scored (`expertcache.config.cache_size_range`: from the trace's
top-k to its experts per layer), so the recommendation is always one ``generate`` takes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from expertcache.config import cache_size_range
from expertcache.manifest import MAX_EXPERT_BYTES
from expertcache.sim import ReplayResult, TraceCalls, replay_streams, trace_calls, unbounded
from expertcache.sim.replay import check_overlap_limit
from expertcache.trace import RoutingTrace
from expertcache.validation import check_int

#: Policies a runtime cache can use (Belady is the bound, not a choice).
RUNTIME_POLICIES = ("lru", "lfu", "slru", "arc", "lfru", "least_stale", "gdsf")
#: Per-layer cache sizes scored besides the budget's, as fractions of a layer's experts.
DEFAULT_FRACTIONS = (0.125, 0.25, 0.375, 0.5, 0.75)


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One policy at one cache size.

    Attributes:
        scope: ``"layer"`` (``slots`` per layer) or ``"global"`` (``slots`` in all).
        slots: cache size in experts.
        fraction: ``slots`` over the experts the pool could hold (``E``, or ``L * E``).
        policy: policy name (``"belady"`` and ``"unbounded"`` are the bounds).
        hits, misses: distinct-expert lookups over the whole trace.
        hit_rate: hits / (hits + misses).
        misses_per_token: misses per token, over ``model_layers`` layers.
        gb_per_token: GB (1e9 bytes) copied host -> GPU per token (``copy_bytes`` a miss).
        tokens_per_second: ``bandwidth / bytes per token`` (None without a bandwidth).
        split_calls: calls with more distinct experts than ``slots`` (run in expert-group passes).
    """

    scope: str
    slots: int
    fraction: float
    policy: str
    hits: int
    misses: int
    hit_rate: float
    misses_per_token: float
    gb_per_token: float
    tokens_per_second: float | None
    split_calls: int


@dataclass(frozen=True)
class Plan:
    """Scores and the recommendation for one budget.

    Attributes:
        rows: every (scope, slots, policy) scored, bounds included.
        budget_slots: slots the GPU budget buys in all (``budget // expert_bytes``).
        layer_cache_size: per-layer slots at the budget (``--moe-expert-cache-size``); below
            ``min_cache_size`` the budget buys no cache the runtime takes (nothing scored there).
        layer_policy: best runtime policy for per-layer pools at the budget.
        global_slots: global-pool slots at the budget for the traced layers
            (``layer_cache_size * L``: the same bytes as the per-layer pools).
        global_policy: best runtime policy for one global pool at the budget.
        budget_fraction: ``layer_cache_size / E``: the share of experts the budget holds.
        min_cache_size: the smallest ``--moe-expert-cache-size`` the runtime takes (the
            trace's top-k; `expertcache.config.cache_size_range`).
    """

    rows: tuple[PlanRow, ...]
    budget_slots: int
    layer_cache_size: int
    layer_policy: str
    global_slots: int
    global_policy: str
    budget_fraction: float
    min_cache_size: int

    def row(self, scope: str, slots: int, policy: str) -> PlanRow:
        """The row of ``policy`` at ``slots`` in ``scope``."""
        for row in self.rows:
            if (row.scope, row.slots, row.policy) == (scope, slots, policy):
                return row
        raise KeyError((scope, slots, policy))


def layer_sizes(num_experts: int, fractions: Sequence[float], extra: Sequence[int], *, smallest: int = 1) -> list[int]:
    """Distinct per-layer cache sizes: ``fractions`` of ``num_experts`` plus ``extra``, each
    in ``[smallest, num_experts]``."""
    wanted = [round(fraction * num_experts) for fraction in fractions] + list(extra)
    return sorted({min(max(smallest, size), num_experts) for size in wanted})


def best_policy(rows: Sequence[PlanRow], *, min_gain: float = 0.005) -> str:
    """The runtime policy with the best hit rate; LRU unless another beats it by ``min_gain``.

    LRU costs least on the critical path, so a policy must win by a margin to replace it.
    """
    runtime = [row for row in rows if row.policy in RUNTIME_POLICIES]
    if not runtime:
        raise ValueError("best_policy needs at least one row of a runtime policy")
    best = max(runtime, key=lambda row: row.hit_rate)
    lru = next((row for row in runtime if row.policy == "lru"), None)
    if lru is not None and best.hit_rate - lru.hit_rate < min_gain:
        return "lru"
    return best.policy


def plan(
    trace: RoutingTrace,
    *,
    expert_bytes: int,
    gpu_budget_bytes: int,
    bandwidth_bytes_per_second: float | None = None,
    model_layers: int | None = None,
    policies: Sequence[str] = RUNTIME_POLICIES,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    min_gain: float = 0.005,
    progress: Callable[[int], Callable[[], None]] | None = None,
    copy_bytes: int | None = None,
    oversize: Literal["passes", "overlapped"] = "passes",
    overlap_max_ids: int | None = None,
) -> Plan:
    """Score ``policies`` (plus Belady and unbounded) at several sizes on ``trace``.

    Args:
        trace: the routing trace (``expert_ids`` ``[N, L, K]``).
        expert_bytes: bytes one expert's record takes in a slot (and per copy, unless
            ``copy_bytes`` says otherwise).
        gpu_budget_bytes: GPU bytes for the expert cache.
        bandwidth_bytes_per_second: host -> GPU copy bandwidth for the tok/s ceiling.
        model_layers: MoE layers of the model (default: the trace's).
        policies: runtime policies to score.
        fractions: per-layer sizes to score, as fractions of a layer's experts.
        min_gain: hit-rate margin a policy needs over LRU to be recommended.
        progress: ``progress(total) -> tick`` to report each finished replay.
        copy_bytes: bytes one miss reads from the host when they differ from
            ``expert_bytes``: a compressed store's record (``Manifest.compressed_expert_bytes``).
        oversize: how a call of more experts than a pool's share is replayed: ``"passes"``
            (one after the other, as ``passes(ids)`` serves it) or ``"overlapped"`` (as
            ``passes(ids, overlap=True)`` does, in a decode stack); see `expertcache.sim.replay`.
        overlap_max_ids: with ``"overlapped"``, calls of more ids than this are replayed as
            passes one after the other (`DecodeStack`: `expertcache.passes.OVERLAP_MAX_IDS`);
            None: every call.

    Raises:
        TypeError / ValueError: any argument of the wrong type or out of range (an empty
            trace, an unknown or repeated policy, a fraction outside (0, 1], no fraction and
            a budget below the smallest cache (nothing to score), fewer model
            layers than the trace records, a bandwidth that is not a positive number, an
            ``expert_bytes`` above `expertcache.manifest.MAX_EXPERT_BYTES`, ``copy_bytes``
            above ``expert_bytes``, an unknown ``oversize``, an ``overlap_max_ids`` without
            ``"overlapped"`` or not a positive int).
    """
    if oversize not in ("passes", "overlapped"):
        raise ValueError(f"oversize must be 'passes' or 'overlapped', got {oversize!r}")
    check_overlap_limit(oversize, overlap_max_ids)
    policies = check_policies(policies)
    expert_bytes, gpu_budget_bytes, model_layers = _check_arguments(
        trace, expert_bytes, gpu_budget_bytes, bandwidth_bytes_per_second, model_layers
    )
    if copy_bytes is not None:
        copy_bytes = _check_count("copy_bytes", copy_bytes, minimum=1)
        if copy_bytes > expert_bytes:
            raise ValueError(f"copy_bytes ({copy_bytes}) must be at most expert_bytes ({expert_bytes}): "
                             "a coded record is never larger than the raw one")  # fmt: skip
    fractions = _check_fractions(fractions)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable progress(total) -> tick, or None; got {type(progress).__name__}")
    if not (_finite_number(min_gain) and min_gain >= 0):
        raise ValueError(f"min_gain must be a non-negative number, got {min_gain!r:.40}")
    layers = model_layers or trace.num_layers
    experts = trace.num_experts
    allowed = cache_size_range(trace.top_k, experts)
    budget_slots = gpu_budget_bytes // expert_bytes
    layer_budget = min(experts, budget_slots // layers)
    sizes = layer_sizes(experts, fractions, [layer_budget] if layer_budget in allowed else [], smallest=allowed.start)
    if not sizes:
        raise ValueError(
            f"nothing to score: fractions is empty and the budget buys {layer_budget} slots a layer, fewer than "
            f"the smallest cache the runtime takes ({allowed.start}, the trace's top-k)"
        )
    per_miss = expert_bytes if copy_bytes is None else copy_bytes
    cost = _Cost(trace.num_tokens, layers / trace.num_layers, per_miss, bandwidth_bytes_per_second)
    names = (*policies, "belady")
    tick = progress(2 * len(sizes) * len(names)) if progress is not None else (lambda: None)
    if not callable(tick):
        raise TypeError(f"progress(total) must return a callable tick, got {type(tick).__name__}")
    rows: list[PlanRow] = []
    for scope in ("layer", "global"):
        streams = trace_calls(trace, scope=scope)
        scale = 1 if scope == "layer" else trace.num_layers
        for size in sizes:
            rows += [
                _score(streams, scope, size * scale, name, cost, tick, oversize, overlap_max_ids) for name in names
            ]
            rows.append(cost.row(scope, size * scale, streams, "unbounded", unbounded(streams)))
    return Plan(
        rows=tuple(rows),
        budget_slots=budget_slots,
        layer_cache_size=layer_budget,
        layer_policy=_best_at(rows, "layer", layer_budget, min_gain),
        global_slots=layer_budget * trace.num_layers,
        global_policy=_best_at(rows, "global", layer_budget * trace.num_layers, min_gain),
        budget_fraction=layer_budget / experts,
        min_cache_size=allowed.start,
    )


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


def _check_arguments(
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


def _check_fractions(fractions: Sequence[float]) -> tuple[float, ...]:
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, Iterable):
        raise TypeError(f"fractions must be a sequence of numbers, got {fractions!r:.40}")
    values = tuple(fractions)
    for fraction in values:
        if not (_finite_number(fraction) and 0 < fraction <= 1):
            raise ValueError(f"fractions must be numbers in (0, 1], got {fraction!r:.40}")
    return tuple(float(fraction) for fraction in values)


def _best_at(rows: list[PlanRow], scope: str, slots: int, min_gain: float) -> str:
    candidates = [row for row in rows if row.scope == scope and row.slots == slots]
    return best_policy(candidates, min_gain=min_gain) if candidates else "lru"


def _score(
    streams: list[TraceCalls],
    scope: str,
    slots: int,
    policy: str,
    cost: _Cost,
    tick: Callable[[], None],
    oversize: Literal["passes", "overlapped"],
    overlap_max_ids: int | None,
) -> PlanRow:
    result = replay_streams(streams, policy=policy, capacity=slots, oversize=oversize, overlap_max_ids=overlap_max_ids)
    tick()
    return cost.row(scope, slots, streams, policy, result)


@dataclass(frozen=True)
class _Cost:
    tokens: int
    layer_scale: float
    copy_bytes: int  # bytes one miss moves host -> GPU
    bandwidth: float | None

    def row(
        self,
        scope: str,
        slots: int,
        streams: list[TraceCalls],
        policy: str,
        result: ReplayResult,
    ) -> PlanRow:
        misses = result.misses * self.layer_scale / max(self.tokens, 1)
        bytes_per_token = misses * self.copy_bytes
        ceiling = None
        if self.bandwidth:
            ceiling = self.bandwidth / bytes_per_token if bytes_per_token else float("inf")
        return PlanRow(
            scope=scope,
            slots=slots,
            fraction=slots / streams[0].num_keys,
            policy=policy,
            hits=result.hits,
            misses=result.misses,
            hit_rate=result.hit_rate,
            misses_per_token=misses,
            gb_per_token=bytes_per_token / 1e9,
            tokens_per_second=ceiling,
            split_calls=result.split_calls,
        )
