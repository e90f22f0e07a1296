"""What a policy's misses at one cache size cost per token: `PlanRow` and the `MissCost` model.

Costs follow from the misses of a replay (`expertcache.sim.ReplayResult`): every miss copies
one expert record host -> GPU (``expert_bytes``; ``copy_bytes`` when the store is
compressed: a slot still holds the raw bytes, PCIe carries the coded ones), so a copy
bandwidth turns bytes per token into a ceiling on tokens per second (copies alone, compute
free). Per-token figures are over the layers the trace records, scaled to the model's layers
when it has more (the traced layers are then assumed representative).

`expertcache.commands.plan_costs` works out the bytes one miss moves from the command's
flags; this module prices the misses `expertcache.planner.plan` counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from expertcache.sim import ReplayResult, TraceCalls


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
class MissCost:
    """The figures that turn one replay's misses into a `PlanRow`.

    Attributes:
        tokens: tokens in the trace (the per-token divisor; at least 1 is used).
        layer_scale: model layers over traced layers (>= 1).
        copy_bytes: bytes one miss moves host -> GPU.
        bandwidth: host -> GPU bytes per second for the tok/s ceiling (None or 0: no ceiling).
    """

    tokens: int
    layer_scale: float
    copy_bytes: int
    bandwidth: float | None

    def row(
        self,
        scope: str,
        slots: int,
        streams: list[TraceCalls],
        policy: str,
        result: ReplayResult,
    ) -> PlanRow:
        """``result`` of ``policy`` at ``slots`` in ``scope`` as a row; ``streams`` are the
        replayed pools' calls (their first's key count is what ``slots`` is a fraction of)."""
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
