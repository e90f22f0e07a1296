"""Statistics and manifests of every rank, gathered over the process group.

`gather_stats` all-gathers each rank's `CacheStats` (exact integer counters) so every rank
sees the per-rank figures and their sum. `rank_manifest` describes what one rank holds for
one layer, from the real allocations (store, slot buffers); `gather_manifests` collects
them from all ranks. (The provider-level ``manifest()`` of issue 5 had not landed when this
was written; the fields below come from the provider's store and pool directly.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from expertcache.parallel.collectives import gather_rows
from expertcache.parallel.layer import ExpertParallelMoE
from expertcache.stats import CacheStats

_FIELDS = tuple(field.name for field in dataclasses.fields(CacheStats))


@dataclass(frozen=True, slots=True)
class RankStats:
    """Cache counters of every rank.

    Attributes:
        per_rank: ``per_rank[r]`` is rank ``r``'s `CacheStats`.
    """

    per_rank: tuple[CacheStats, ...]

    @property
    def total(self) -> CacheStats:
        """The sum over ranks (hit rate of the whole group)."""
        return sum(self.per_rank, CacheStats())


def gather_stats(
    stats: CacheStats,
    *,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
) -> RankStats:
    """All-gather this rank's counters; every rank must call it.

    Args:
        stats: this rank's counters (e.g. ``layer.stats``, or a sum over layers).
        device: where the exchanged int64 tensor lives (``"cpu"`` for gloo, the rank's
            GPU for NCCL).
        group: the process group (None: the world).
    """
    values = torch.tensor([[getattr(stats, name) for name in _FIELDS]], dtype=torch.int64)
    gathered, _ = gather_rows(values.to(device), 1, fill=0, group=group)
    return RankStats(tuple(CacheStats(*row) for row in gathered.cpu().tolist()))


def rank_manifest(layer: ExpertParallelMoE) -> dict[str, Any]:
    """What this rank holds for ``layer``, JSON-serialisable.

    Returns:
        ``rank``, ``world_size``, ``scheme``, ``experts`` (owned global ids),
        ``resident`` (global ids in slots now), ``num_slots``, ``record_bytes`` (one
        expert, with alignment), ``payload_bytes`` (one expert, without), ``tensors``
        (name, per-expert shape, dtype, bytes), ``host_bytes`` and ``pinned_bytes`` of the
        backing store, ``gpu_bytes`` of the slot buffers (on ``device``),
        ``full_residency_bytes`` (all owned experts on the device) and ``stats``.
    """
    provider = layer.local.provider
    store, pool = provider.store, provider.pool
    layout = pool.layout
    return {
        "rank": layer.rank,
        "world_size": layer.world_size,
        "scheme": layer.local.partition.scheme,
        "experts": list(layer.local.global_ids),
        "resident": sorted(layer.resident_experts()),
        "num_slots": pool.num_slots,
        "record_bytes": layout.record_bytes,
        "payload_bytes": layout.payload_bytes,
        "tensors": [
            {"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype), "bytes": s.nbytes} for s in layout.specs
        ],
        "host_bytes": store.nbytes,
        "pinned_bytes": store.nbytes if store.pinned else 0,
        "device": str(pool.device),
        "gpu_bytes": pool.nbytes,
        "full_residency_bytes": store.num_experts * layout.record_bytes,
        "stats": dataclasses.asdict(layer.stats),
    }


def gather_manifests(layer: ExpertParallelMoE, *, group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Every rank's `rank_manifest` of ``layer``, in rank order; every rank must call it."""
    manifests: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(manifests, rank_manifest(layer), group=group)
    return manifests
