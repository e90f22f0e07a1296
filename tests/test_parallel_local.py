"""`LocalExperts`: each rank's share of a layer, all ranks in one process (no collectives).

Selecting every (token, choice) from the rank that owns its expert and summing in k order
gives `moe_forward` of the full layer bit for bit in fp32. On a GPU this is also the
single-rank path of expert parallelism, with an ``expert_map`` holding half the experts.
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices
from helpers import random_topk, random_weights

from expertcache.parallel import ExpertPartition, LocalExperts
from expertcache.reference import combine_expert_outputs, expert_outputs, moe_forward

HIDDEN, INTER = 16, 8
STEPS = 60


def routed_batch(tokens, top_k, num_experts, generator, device, dtype=torch.float32):
    """Random tokens, router weights, and ids with about one row in six skipped (-1)."""
    ids = random_topk(tokens, top_k, num_experts, generator=generator)
    skipped = torch.rand(tokens, generator=generator) < 1 / 6
    ids[skipped, -1] = -1  # a dropped choice, as in traces with missing records
    hidden = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
    weights = torch.rand(tokens, top_k, generator=generator)
    return hidden.to(device), weights.to(device), ids.to(device)


def combined(ranks, partition, hidden, router_weights, ids):
    """Each (token, choice) taken from its owner's outputs, then the k-order sum."""
    outputs = torch.stack([rank.outputs(hidden, ids) for rank in ranks])  # [R, T, K, H]
    owner = torch.from_numpy(partition.owners()).to(ids.device)[ids.clamp(min=0)]
    index = owner[None, :, :, None].expand(1, *outputs.shape[1:])
    return combine_expert_outputs(outputs.gather(0, index)[0], router_weights)


def check_only_own_experts_resident(rank, partition, weights):
    own = set(partition.local_experts(rank.rank))
    assert rank.resident_experts() <= own
    pool = rank.provider.pool.tensors
    for expert in rank.resident_experts():
        slot = rank.provider.slot_of(rank.global_ids.index(expert))
        for name in weights:
            assert torch.equal(pool[name][slot].cpu(), weights[name][expert])


# (num_experts, world_size, scheme, cache_size, max_tokens) and the edge each covers.
LAYOUTS = [
    pytest.param(8, 2, "contiguous", 3, 3, id="2 ranks, half the experts each"),
    pytest.param(10, 4, "round_robin", 2, 4, id="4 uneven ranks, overflow groups"),
    pytest.param(6, 1, "contiguous", 6, 2, id="one rank owns all"),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("num_experts, world_size, scheme, cache_size, max_tokens", LAYOUTS)
def test_ranks_together_equal_the_reference(device, num_experts, world_size, scheme, cache_size, max_tokens):
    gen = torch.Generator().manual_seed(num_experts * 10 + world_size)
    partition = ExpertPartition(num_experts, world_size, scheme)
    weights = random_weights(num_experts, HIDDEN, INTER, generator=gen)
    ranks = [
        LocalExperts.from_full_weights(
            weights,
            partition,
            rank,
            cache_size=min(cache_size, len(partition.local_experts(rank))),
            device=device,
        )
        for rank in range(world_size)
    ]
    full = {name: t.to(device) for name, t in weights.items()}
    for _ in range(STEPS):
        tokens = int(torch.randint(1, max_tokens + 1, (), generator=gen))
        hidden, router_weights, ids = routed_batch(tokens, 3, num_experts, gen, device)
        ours = combined(ranks, partition, hidden, router_weights, ids)
        reference = moe_forward(hidden, full["w1"], full["w2"], router_weights, ids)
        assert torch.equal(ours, reference)
        for rank in ranks:
            check_only_own_experts_resident(rank, partition, weights)


@pytest.mark.parametrize("device", devices())
def test_one_rank_with_half_the_experts(device):
    """The single-rank path: rank 0 of 2 computes exactly its share, zeros for the rest."""
    gen = torch.Generator().manual_seed(5)
    partition = ExpertPartition(16, 2, "round_robin")
    weights = random_weights(16, HIDDEN, INTER, generator=gen)
    rank = LocalExperts.from_full_weights(weights, partition, 0, cache_size=4, device=device)
    full = {name: t.to(device) for name, t in weights.items()}
    mine = torch.from_numpy(partition.owners() == 0).to(device)
    distinct_local = 0
    for _ in range(STEPS):
        hidden, _, ids = routed_batch(2, 2, 16, gen, device)
        expected = expert_outputs(
            hidden,
            full["w1"],
            full["w2"],
            torch.where(mine[ids.clamp(min=0)] & (ids >= 0), ids, -1),
        )
        assert torch.equal(rank.outputs(hidden, ids), expected)
        check_only_own_experts_resident(rank, partition, weights)
        distinct_local += len({e for e in ids.flatten().tolist() if e >= 0 and e % 2 == 0})
    stats = rank.stats
    assert stats.hits + stats.misses == distinct_local
    assert stats.bytes_h2d == stats.misses * rank.provider.pool.layout.expert_bytes


@pytest.mark.parametrize("device", devices())
def test_prefill_with_more_local_experts_than_slots(device):
    """64 tokens use nearly all 8 local experts; 2 slots serve them in 4+ groups."""
    gen = torch.Generator().manual_seed(9)
    partition = ExpertPartition(16, 2)
    weights = random_weights(16, HIDDEN, INTER, generator=gen)
    ranks = [LocalExperts.from_full_weights(weights, partition, r, cache_size=2, device=device) for r in range(2)]
    hidden, router_weights, ids = routed_batch(64, 4, 16, gen, device)
    full = {name: t.to(device) for name, t in weights.items()}
    reference = moe_forward(hidden, full["w1"], full["w2"], router_weights, ids)
    assert torch.equal(combined(ranks, partition, hidden, router_weights, ids), reference)
    for rank in ranks:
        used = {e for e in ids.flatten().tolist() if e in rank.global_ids}
        assert rank.stats.misses == len(used) > 2


def test_a_call_where_every_choice_is_skipped_gives_zeros():
    partition = ExpertPartition(4, 2)
    rank = LocalExperts.from_full_weights(random_weights(4, HIDDEN, INTER), partition, 1, cache_size=1, device="cpu")
    out = rank.outputs(torch.randn(3, HIDDEN), torch.full((3, 2), -1))
    assert torch.equal(out, torch.zeros(3, 2, HIDDEN))
