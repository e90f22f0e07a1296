"""One rank of the gloo tests in `test_parallel_gloo` (a module, so that spawn can import it).

Every rank draws the same random layer and the same per-step batches of all ranks from one
seed, runs its own tokens through `ExpertParallelMoE`, and checks its rows against
`moe_forward` of the full layer on all ranks' tokens concatenated in rank order.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import random_topk, random_weights

from expertcache.parallel import (
    ExpertParallelMoE,
    ExpertPartition,
    LocalExperts,
    gather_manifests,
    gather_stats,
)
from expertcache.reference import moe_forward

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 10, 3, 16, 8  # 4 ranks own 3,3,2,2
CACHE_SIZE = 2  # below the experts one step can use on a rank: evictions and groups happen


def check_rank(rank: int, world_size: int, scheme: str, steps: int, pacing: bool) -> None:
    gen = torch.Generator().manual_seed(1234)
    partition = ExpertPartition(NUM_EXPERTS, world_size, scheme)
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER, generator=gen)
    local = LocalExperts.from_full_weights(weights, partition, rank, cache_size=CACHE_SIZE, device="cpu")
    layer = ExpertParallelMoE(local, pacing=pacing, pacing_chunk_bytes=200)
    other = (rank + 1) % world_size
    if other != rank:  # experts built for another rank are refused before any collective
        wrong = LocalExperts.from_full_weights(weights, partition, other, cache_size=CACHE_SIZE, device="cpu")
        with pytest.raises(ValueError, match="built for rank"):
            ExpertParallelMoE(wrong)
    owners = partition.owners()
    expected_lookups = [0] * world_size
    for _ in range(steps):
        # 0..3 tokens per rank: ranks differ, and now and then one (or all) have none
        counts = torch.randint(0, 4, (world_size,), generator=gen).tolist()
        batches = [step_batch(count, gen) for count in counts]
        hidden, router_weights, ids = (torch.cat(parts) for parts in zip(*batches, strict=True))
        ours = layer(*batches[rank])
        start = sum(counts[:rank])
        if hidden.shape[0]:
            reference = moe_forward(hidden, weights["w1"], weights["w2"], router_weights, ids)
            assert torch.equal(ours, reference[start : start + counts[rank]])
        assert ours.shape == (counts[rank], HIDDEN)
        assert layer.resident_experts() <= set(partition.local_experts(rank))
        used = {e for e in ids.flatten().tolist() if e >= 0}
        for r in range(world_size):
            expected_lookups[r] += sum(1 for e in used if owners[e] == r)
    check_summary(layer, partition, expected_lookups, pacing)


def step_batch(count: int, gen: torch.Generator):
    ids = random_topk(count, TOP_K, NUM_EXPERTS, generator=gen)
    ids[torch.rand(count, generator=gen) < 0.2, 0] = -1  # dropped choices skip
    hidden = torch.randn(count, HIDDEN, generator=gen)
    return hidden, torch.rand(count, TOP_K, generator=gen), ids


def check_summary(layer, partition, expected_lookups, pacing) -> None:
    gathered = gather_stats(layer.stats)
    assert gathered.per_rank[layer.rank] == layer.stats
    assert [s.hits + s.misses for s in gathered.per_rank] == expected_lookups
    assert gathered.total.misses == sum(s.misses for s in gathered.per_rank)
    manifests = gather_manifests(layer)
    for rank, manifest in enumerate(manifests):
        experts = list(partition.local_experts(rank))
        assert manifest["rank"] == rank and manifest["experts"] == experts
        assert set(manifest["resident"]) <= set(experts)
        assert manifest["host_bytes"] >= len(experts) * manifest["expert_bytes"]
        assert manifest["pool_gpu_bytes"] >= CACHE_SIZE * manifest["expert_bytes"]
        assert manifest["stats"]["misses"] == gathered.per_rank[rank].misses
    tensor_bytes = [entry["bytes"] for entry in manifests[layer.rank]["tensors"]]
    paced = layer.pacer.stats
    if pacing:
        assert paced.experts == layer.stats.misses
        assert paced.chunks == layer.stats.misses * sum(math.ceil(size / 200) for size in tensor_bytes)
    else:
        assert paced.experts == paced.chunks == paced.holds == 0
