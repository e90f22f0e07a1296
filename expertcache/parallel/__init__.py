"""Expert parallelism: each rank serves its own experts from its own slot cache.

* `ExpertPartition` places the experts on the ranks (contiguous blocks or round robin).
* `LocalExperts` is one rank's share with no communication (the single-rank path).
* `ExpertParallelMoE` adds the collectives: all-gather of tokens and routing, local experts
  computed, per-choice outputs returned by all-to-all and combined exactly as the
  single-process reference does.
* `CopyPacer` optionally holds expert copies back while a collective is in flight.
* `gather_stats` and `gather_manifests` collect every rank's counters and holdings.

Bad input raises before any cache or collective acts (`inputs`: one rank's checks;
`agreement`: the all-reduce that makes every rank raise alike), so nothing changes.
"""

from expertcache.parallel.layer import ExpertParallelMoE
from expertcache.parallel.local import LocalExperts
from expertcache.parallel.pacing import CopyPacer, PacingStats
from expertcache.parallel.partition import ExpertPartition
from expertcache.parallel.summary import RankStats, gather_manifests, gather_stats, rank_manifest

__all__ = [
    "CopyPacer",
    "ExpertParallelMoE",
    "ExpertPartition",
    "LocalExperts",
    "PacingStats",
    "RankStats",
    "gather_manifests",
    "gather_stats",
    "rank_manifest",
]
