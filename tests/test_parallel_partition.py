"""`ExpertPartition`: every expert has one owner, ranks are balanced, maps agree."""

from __future__ import annotations

import pytest
import torch

from expertcache.parallel import ExpertPartition

# (num_experts, world_size) and the edge each covers.
CASES = [
    pytest.param(8, 1, id="one rank owns all"),
    pytest.param(8, 2, id="even split"),
    pytest.param(10, 4, id="uneven: 3,3,2,2"),
    pytest.param(7, 7, id="one expert per rank"),
    pytest.param(128, 2, id="Qwen3-30B-A3B on two GPUs"),
]


@pytest.mark.parametrize("scheme", ["contiguous", "round_robin"])
@pytest.mark.parametrize("num_experts, world_size", CASES)
def test_every_expert_has_exactly_one_owner(num_experts, world_size, scheme):
    partition = ExpertPartition(num_experts, world_size, scheme)
    owned = [partition.local_experts(rank) for rank in range(world_size)]
    assert sorted(e for experts in owned for e in experts) == list(range(num_experts))
    sizes = [len(experts) for experts in owned]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    owners = partition.owners()
    for rank, experts in enumerate(owned):
        assert list(experts) == sorted(experts)
        assert all(owners[e] == rank for e in experts)
        table = partition.expert_map(rank)
        assert table.dtype == torch.int32 and table.shape == (num_experts,)
        assert table[list(experts)].tolist() == list(range(len(experts)))
        assert int((table >= 0).sum()) == len(experts)


def test_contiguous_blocks_put_the_extra_experts_first():
    partition = ExpertPartition(10, 4, "contiguous")
    assert [partition.local_experts(r) for r in range(4)] == [
        (0, 1, 2),
        (3, 4, 5),
        (6, 7),
        (8, 9),
    ]


def test_round_robin_deals_experts_like_cards():
    partition = ExpertPartition(10, 4, "round_robin")
    assert [partition.local_experts(r) for r in range(4)] == [(0, 4, 8), (1, 5, 9), (2, 6), (3, 7)]


@pytest.mark.parametrize(
    "args, match",
    [
        ((4, 5), "every rank must own"),
        ((4, 0), "world_size must be >= 1"),
        ((0, 1), "num_experts must be >= 1"),
        ((4, 2, "striped"), "unknown scheme"),
    ],
)
def test_bad_partitions_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        ExpertPartition(*args)


def test_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="outside"):
        ExpertPartition(8, 2).local_experts(2)
