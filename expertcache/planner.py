"""Capacity planning: score policies x cache sizes on a routing trace, recommend a size.

For each pool kind (a pool per layer, or one global pool for all layers) and each cache
size, every policy replays the trace through the runtime's own admission
(`expertcache.sim`); Belady's MIN gives the bound at that size and an unbounded cache the
bound at any size. This module owns that search and the recommendation (`Plan`,
`best_policy`); what the misses cost per token, in bytes and tokens per second, is
`expertcache.planner_costs` (`PlanRow`), and what the arguments must be is
`expertcache.planner_checks` (`RUNTIME_POLICIES`, `check_policies`). All three names are
importable from here too.

Only cache sizes a runtime cache accepts are scored (`expertcache.config.cache_size_range`:
from the trace's top-k to its experts per layer), so the recommendation is always one
``generate`` takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from expertcache.config import cache_size_range
from expertcache.planner_checks import (
    RUNTIME_POLICIES,
    check_copy_bytes,
    check_fractions,
    check_min_gain,
    check_plan_arguments,
    check_policies,
    check_progress,
)
from expertcache.planner_costs import MissCost, PlanRow
from expertcache.sim import TraceCalls, replay_streams, trace_calls, unbounded
from expertcache.sim.replay import check_overlap_limit
from expertcache.trace import RoutingTrace

__all__ = [
    "DEFAULT_FRACTIONS",
    "RUNTIME_POLICIES",
    "Plan",
    "PlanRow",
    "best_policy",
    "check_policies",
    "layer_sizes",
    "plan",
]

#: Per-layer cache sizes scored besides the budget's, as fractions of a layer's experts.
DEFAULT_FRACTIONS = (0.125, 0.25, 0.375, 0.5, 0.75)


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
    expert_bytes, gpu_budget_bytes, model_layers = check_plan_arguments(
        trace, expert_bytes, gpu_budget_bytes, bandwidth_bytes_per_second, model_layers
    )
    if copy_bytes is not None:
        copy_bytes = check_copy_bytes(copy_bytes, expert_bytes)
    fractions = check_fractions(fractions)
    check_progress(progress)
    check_min_gain(min_gain)
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
    cost = MissCost(trace.num_tokens, layers / trace.num_layers, per_miss, bandwidth_bytes_per_second)
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


def _best_at(rows: list[PlanRow], scope: str, slots: int, min_gain: float) -> str:
    candidates = [row for row in rows if row.scope == scope and row.slots == slots]
    return best_policy(candidates, min_gain=min_gain) if candidates else "lru"


def _score(
    streams: list[TraceCalls],
    scope: str,
    slots: int,
    policy: str,
    cost: MissCost,
    tick: Callable[[], None],
    oversize: Literal["passes", "overlapped"],
    overlap_max_ids: int | None,
) -> PlanRow:
    result = replay_streams(streams, policy=policy, capacity=slots, oversize=oversize, overlap_max_ids=overlap_max_ids)
    tick()
    return cost.row(scope, slots, streams, policy, result)
