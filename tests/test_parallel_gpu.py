"""Expert parallelism on one GPU, at Qwen3-30B-A3B shapes (H=2048, I=768, E=128, top-8).

Two ranks need two GPUs; on one GPU the single-rank path runs with an ``expert_map``
holding half the experts (rank 0 of 2), and the collective path runs over a one-rank NCCL
group. Both are checked for exact equality with the reference on the full weights, in fp32
and bf16: the same rows meet the same expert's weights in the same shapes, so a
deterministic matmul gives the same bits.
"""

from __future__ import annotations

import pytest
import torch
from process_groups import free_port, process_group

from expertcache.parallel import ExpertParallelMoE, ExpertPartition, LocalExperts, gather_stats
from expertcache.reference import expert_outputs, moe_forward

pytestmark = pytest.mark.gpu

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 2048, 768, 128, 8
STEPS = 60
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def qwen3_weights(dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w1": (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda") / HIDDEN**0.5).to(dtype),
        "w2": (torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen, device="cuda") / INTER**0.5).to(dtype),
    }


def decode_batch(gen, dtype, max_tokens=4):
    tokens = int(torch.randint(1, max_tokens + 1, (), generator=gen))
    ids = torch.rand(tokens, NUM_EXPERTS, generator=gen).topk(TOP_K, dim=-1).indices
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    return hidden.cuda(), torch.rand(tokens, TOP_K, generator=gen).cuda(), ids.cuda()


def assert_same_bits(ours, reference):
    assert torch.equal(ours, reference), f"max |diff| {(ours - reference).abs().max().item():.3g}"


@pytest.mark.parametrize("cache_fraction", [0.25, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_with_half_the_experts_on_one_gpu(dtype, cache_fraction):
    """Rank 0 of 2 (64 experts) computes exactly its share and loads nothing else."""
    partition = ExpertPartition(NUM_EXPERTS, 2, "contiguous")
    full = qwen3_weights(dtype)
    local_count = len(partition.local_experts(0))
    rank = LocalExperts.from_full_weights(
        {name: t.cpu() for name, t in full.items()},
        partition,
        0,
        cache_size=int(cache_fraction * local_count),
        device="cuda",
    )
    mine = torch.from_numpy(partition.owners() == 0).cuda()
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        hidden, _, ids = decode_batch(gen, dtype)
        expected = expert_outputs(hidden, full["w1"], full["w2"], torch.where(mine[ids], ids, -1))
        assert_same_bits(rank.outputs(hidden, ids), expected)
        assert rank.resident_experts() <= set(partition.local_experts(0))
    assert rank.stats.misses > 0 and rank.stats.hits > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_over_a_one_rank_nccl_group(dtype):
    """The collective path (all-gather, all-to-all) on CUDA tensors through NCCL."""
    torch.cuda.set_device(0)
    with process_group("nccl", port=free_port()):
        full = qwen3_weights(dtype, seed=2)
        partition = ExpertPartition(NUM_EXPERTS, 1)
        local = LocalExperts.from_full_weights(
            {name: t.cpu() for name, t in full.items()},
            partition,
            0,
            cache_size=NUM_EXPERTS // 4,
            device="cuda",
        )
        layer = ExpertParallelMoE(local)
        gen = torch.Generator().manual_seed(3)
        for _ in range(STEPS):
            hidden, router_weights, ids = decode_batch(gen, dtype)
            reference = moe_forward(hidden, full["w1"], full["w2"], router_weights, ids)
            assert_same_bits(layer(hidden, router_weights, ids), reference)
        gathered = gather_stats(layer.stats, device="cuda")
        assert gathered.per_rank == (layer.stats,)
