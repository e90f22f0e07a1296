"""Statistics and manifests of every rank, gathered over the process group.

`gather_stats` all-gathers each rank's `CacheStats` (exact integer counters) so every rank
sees the per-rank figures and their sum. `rank_manifest` describes what one rank holds for
one layer (the provider's manifest plus the rank's experts); `gather_manifests` collects
them from all ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from expertcache.parallel.collectives import gather_rows
from expertcache.parallel.layer import ExpertParallelMoE
from expertcache.stats import CacheStats, checked_counts
from expertcache.validation import resolve_device

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
    device: torch.device | str | None = "cpu",
    group: dist.ProcessGroup | None = None,
) -> RankStats:
    """All-gather this rank's counters; every rank must call it.

    Args:
        stats: this rank's `CacheStats` (e.g. ``layer.stats``, or a sum over layers).
        device: where the exchanged int64 tensor lives (``"cpu"`` for gloo, the rank's
            GPU for NCCL; None: the current CUDA device, else the CPU).
        group: the process group (None: the world).

    Raises:
        TypeError: ``stats`` is not a `CacheStats`, or a counter of it is not an integer.
            ValueError: a counter is negative or beyond int64, or ``device`` is not the CPU
            or a CUDA device of this machine. A rank that refuses its arguments still
            joins the gather (on its backend's device), flagged; it raises its own error
            and every other rank a ValueError naming it, so no rank is left waiting.
    """
    refusal: Exception | None = None
    try:
        if not isinstance(stats, CacheStats):
            raise TypeError(f"stats must be a CacheStats (e.g. layer.stats), got {type(stats).__name__}")
        counters = list(checked_counts(stats))  # int64 counts: 1.5 is not truncated to 1
        target = resolve_device(device)
    except (TypeError, ValueError) as error:
        if not dist.is_initialized():
            raise  # no group to tell
        refusal, target, counters = error, _backend_device(group), [0] * len(_FIELDS)
    row = torch.tensor([[int(refusal is not None), *counters]], dtype=torch.int64)
    gathered, _ = gather_rows(row.to(target), 1, fill=0, group=group)
    rows = gathered.cpu().tolist()
    _raise_refusals(refusal, [row[0] == 1 for row in rows], "gather_stats")
    return RankStats(tuple(CacheStats(*row[1:]) for row in rows))


def _backend_device(group: dist.ProcessGroup | None) -> torch.device:
    """A device the group's collectives take: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raise_refusals(refusal: Exception | None, refused: list[bool], what: str) -> None:
    """After a collective that carried every rank's verdict: this rank's own error, else a
    ValueError naming the ranks that refused their arguments."""
    if refusal is not None:
        raise refusal
    ranks = [rank for rank, flag in enumerate(refused) if flag]
    if ranks:
        raise ValueError(f"rank(s) {ranks} refused their arguments to {what} (see their error); nothing was gathered")


def rank_manifest(layer: ExpertParallelMoE) -> dict[str, Any]:
    """What this rank holds for ``layer`` (an `ExpertParallelMoE`), JSON-serialisable.

    Returns:
        the provider's manifest (`expertcache.manifest.Manifest.to_dict`: tensors, slots,
        record, pool, host and pinned bytes) plus ``rank``, ``world_size``, ``scheme``,
        ``experts`` (owned global ids), ``resident`` (global ids in slots now) and ``stats``.

    Raises:
        TypeError: ``layer`` is not an `ExpertParallelMoE` (a `LocalExperts` is wrapped in one).
    """
    if not isinstance(layer, ExpertParallelMoE):
        raise TypeError(f"layer must be an ExpertParallelMoE, got {type(layer).__name__}")
    return {
        **layer.local.provider.manifest().to_dict(),
        "rank": layer.rank,
        "world_size": layer.world_size,
        "scheme": layer.local.partition.scheme,
        "experts": list(layer.local.global_ids),  # the ids themselves, not only their count
        "resident": sorted(layer.resident_experts()),
        "stats": dataclasses.asdict(layer.stats),
    }


def gather_manifests(layer: ExpertParallelMoE, *, group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Every rank's `rank_manifest` of ``layer``, in rank order; every rank must call it.

    A rank whose manifest cannot be built (``layer`` refused as in `rank_manifest`, or any
    error while reading the layer) still joins the gather, with its error's name and message
    in place of a manifest: it raises its own error, and every other rank one ValueError
    naming the ranks and their errors. No rank waits, and the next gather pairs as ever.

    Raises:
        TypeError: ``layer`` is not an `ExpertParallelMoE` (this rank's own error; the others
            raise the ValueError below). Any other ``Exception`` building the manifest, on the
            rank that hit it. ValueError: another rank refused ``layer`` or failed.
    """
    error: Exception | None = None
    try:
        mine: dict[str, Any] | _RankError = rank_manifest(layer)
    except Exception as caught:  # any kind: it joins the gather all the same, so that no rank waits
        if not dist.is_initialized():
            raise  # no group to tell
        error = caught
        mine = _RankError(refused=not isinstance(layer, ExpertParallelMoE), what=_describe(caught))
    manifests: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(manifests, mine, group=group)
    if error is not None:
        raise error
    failed = {rank: entry for rank, entry in enumerate(manifests) if isinstance(entry, _RankError)}
    if failed:
        raise ValueError(_failure_message(failed, "gather_manifests"))
    return manifests


class _RankError(NamedTuple):
    """What a rank that could not build its manifest sends instead (pickled, small)."""

    refused: bool  # its argument was not a layer (the others read: refused their arguments)
    what: str  # "TypeName: message", cut short


def _describe(error: Exception) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 200 else text[:197] + "..."


def _failure_message(failed: dict[int, _RankError], what: str) -> str:
    ranks = sorted(failed)
    details = "; ".join(f"rank {rank}: {failed[rank].what}" for rank in ranks)
    verb = f"refused their arguments to {what}" if all(e.refused for e in failed.values()) else f"failed in {what}"
    return f"rank(s) {ranks} {verb} ({details}); nothing was gathered"
