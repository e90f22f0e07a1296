"""Bad input to expert parallelism gets a clear error and changes nothing.

For `LocalExperts`, `ExpertParallelMoE` (a one-rank gloo group in this process, and two
ranks in two processes for what only several ranks can get wrong), `ExpertPartition`,
`CopyPacer` and the summaries: each wrong type, shape, dtype, device or id raises a named
error before the cache admits or copies anything, so ``stats`` and the resident experts
are what they were, and the next good call still equals the reference. A call with nothing
to compute loads nothing; pacing belongs to the layer that asked for it.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
from helpers import random_weights
from process_groups import process_group, run_ranks

from expertcache import CachedWeightProvider
from expertcache.parallel import (
    CopyPacer,
    ExpertParallelMoE,
    ExpertPartition,
    LocalExperts,
    PacingStats,
    gather_manifests,
    gather_stats,
    rank_manifest,
)
from expertcache.reference import expert_outputs, moe_forward

NUM_EXPERTS, HIDDEN, INTER = 8, 16, 8
WEIGHTS = random_weights(NUM_EXPERTS, HIDDEN, INTER, generator=torch.Generator().manual_seed(0))
IDS = torch.tensor([[0, 1], [2, 3], [1, 5]])  # the bad calls' ids: they would load 0..3 and evict


def warm_rank(cache_size: int = 4) -> LocalExperts:
    """The only rank of one, experts 4..7 resident in its 4 slots."""
    local = LocalExperts.from_full_weights(
        WEIGHTS, ExpertPartition(NUM_EXPERTS, 1), 0, cache_size=cache_size, device="cpu"
    )
    local.outputs(torch.randn(2, HIDDEN), torch.tensor([[4, 5], [6, 7]]))
    return local


def snapshot(layer) -> tuple:
    return layer.stats, layer.resident_experts()


def assert_local_still_works(local: LocalExperts) -> None:
    hidden = torch.randn(3, HIDDEN)
    assert torch.equal(local.outputs(hidden, IDS), expert_outputs(hidden, WEIGHTS["w1"], WEIGHTS["w2"], IDS))


# -- LocalExperts: hidden and ids checked before the cache acts (finding 1) -------------------

BAD_HIDDEN = [
    pytest.param(torch.randn(3, 15), ValueError, r"hidden must be \[T, H=16\]", id="H 15 for weights of H 16"),
    pytest.param(torch.randn(16), ValueError, r"hidden must be \[T, H=16\]", id="1-D"),
    pytest.param(torch.randn(3, 16, dtype=torch.float64), TypeError, "weights' dtype torch.float32", id="float64"),
    pytest.param(torch.randn(3, 16).bfloat16(), TypeError, "weights' dtype torch.float32", id="bf16"),
    pytest.param(torch.ones(3, 16, dtype=torch.int64), TypeError, "weights' dtype", id="int64"),
    pytest.param(torch.randn(2, 16), ValueError, "hidden has 2 rows but topk_ids 3", id="fewer rows than ids"),
    pytest.param(torch.randn(4, 16), ValueError, "hidden has 4 rows but topk_ids 3", id="more rows (once dropped)"),
    pytest.param(torch.empty(3, 16, device="meta"), ValueError, "hidden is on meta", id="another device"),
    pytest.param([[0.0] * 16] * 3, TypeError, "hidden must be a tensor", id="a list"),
    pytest.param(torch.randn(3, 16).to_sparse(), TypeError, "hidden must be a dense", id="sparse"),
]


@pytest.mark.parametrize("hidden, error, match", BAD_HIDDEN)
def test_local_refuses_bad_hidden_before_the_cache_acts(hidden, error, match):
    local = warm_rank()
    before = snapshot(local)
    with pytest.raises(error, match=match):
        local.outputs(hidden, IDS)
    assert snapshot(local) == before
    assert_local_still_works(local)


@pytest.mark.parametrize("bad_id", [8, -2], ids=["E", "-2"])
def test_local_refuses_ids_outside_the_layer_naming_the_skip_id(bad_id):
    local = warm_rank()
    before = snapshot(local)
    with pytest.raises(IndexError, match=rf"expert id {bad_id} in topk_ids is outside \[-1, 8\) \(-1 = skip\)"):
        local.outputs(torch.randn(1, HIDDEN), torch.tensor([[0, bad_id]]))
    assert snapshot(local) == before


@pytest.mark.parametrize(
    "activation, error, match",
    [("relu", ValueError, "unknown activation 'relu'"), (None, TypeError, "activation must be one of")],
)
def test_local_refuses_an_unknown_activation_when_built(activation, error, match):
    with pytest.raises(error, match=match):
        LocalExperts.from_full_weights(
            WEIGHTS, ExpertPartition(8, 1), 0, cache_size=2, device="cpu", activation=activation
        )


# -- a call with nothing to compute (finding 2) -----------------------------------------------


@pytest.mark.parametrize(
    "ids",
    [torch.full((2, 2), -1), torch.full((2, 2), -1, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int64)],
    ids=["every id -1", "every id -1, int32", "no tokens"],
)
def test_a_call_with_nothing_to_compute_loads_and_evicts_nothing(ids):
    local = warm_rank()
    (stats, resident) = snapshot(local)
    out = local.outputs(torch.randn(ids.shape[0], HIDDEN), ids)
    assert torch.equal(out, torch.zeros(ids.shape[0], 2, HIDDEN))
    assert local.resident_experts() == resident == {4, 5, 6, 7}
    after = local.stats
    assert (after.hits, after.misses, after.evictions, after.bytes_h2d) == (
        stats.hits,
        stats.misses,
        stats.evictions,
        stats.bytes_h2d,
    )
    assert after.calls == stats.calls + 1  # counted like any call, as one of no tokens


@pytest.mark.parametrize(
    "partition, rank, ids, loaded",
    [
        # the -1s take the call's largest id, 5: used anyway
        (ExpertPartition(8, 1), 0, [[3, -1], [-1, 5]], {3, 5}),
        # the largest id, 6, is rank 1's: the -1s map to no local expert
        (ExpertPartition(8, 2), 0, [[1, -1], [6, -1]], {1}),
        # 4 local experts through 2 slots (passes) with skips in between
        (ExpertPartition(8, 1), 0, [[0, -1], [1, 2], [-1, 3], [-1, -1]], {0, 1, 2, 3}),
    ],
    ids=["largest id local", "largest id another rank's", "in passes"],
)
def test_skipped_choices_load_only_the_experts_the_call_uses(partition, rank, ids, loaded):
    local = LocalExperts.from_full_weights(WEIGHTS, partition, rank, cache_size=2, device="cpu")
    ids = torch.tensor(ids)
    hidden = torch.randn(ids.shape[0], HIDDEN)
    mine = torch.from_numpy(partition.owners() == rank)[ids.clamp(min=0)] & (ids >= 0)
    expected = expert_outputs(hidden, WEIGHTS["w1"], WEIGHTS["w2"], torch.where(mine, ids, -1))
    assert torch.equal(local.outputs(hidden, ids), expected)
    assert local.stats.misses == len(loaded) and local.stats.hits == 0
    assert local.resident_experts() <= loaded


# -- LocalExperts: the weights and the rank (findings 4, 5) -----------------------------------


@pytest.mark.parametrize("num_experts", [16, 6], ids=["E 16", "E 6"])
def test_full_weights_must_hold_the_partitions_experts(num_experts):
    weights = random_weights(num_experts, HIDDEN, INTER)
    with pytest.raises(ValueError, match=f"holds {num_experts} experts, but the partition places 8"):
        LocalExperts.from_full_weights(weights, ExpertPartition(8, 2), 1, cache_size=2, device="cpu")


@pytest.mark.parametrize(
    "weights, error, match",
    [
        ({n: t[:3] for n, t in WEIGHTS.items()}, ValueError, "weights hold 3 experts, but rank 0 owns 4"),
        (random_weights(4, HIDDEN, INTER, extras=True), ValueError, r"ignore \['bias', 'w1_scale', 'w2_scale'\]"),
        ({"w1": WEIGHTS["w1"][:4], "w2": WEIGHTS["w2"][:4].double()}, TypeError, "w1 and w2 must share"),
        ({"w1": WEIGHTS["w1"][:4].transpose(1, 2), "w2": WEIGHTS["w2"][:4].transpose(1, 2)}, ValueError, "x @ W.T"),
    ],
    ids=["3 experts for 4", "scales and a bias", "w2 float64", "x @ W layout"],
)
def test_local_weights_the_reference_cannot_compute_are_refused(weights, error, match):
    with pytest.raises(error, match=match):
        LocalExperts(weights, ExpertPartition(8, 2), 0, cache_size=2, device="cpu")


NOT_RANKS = [True, 1.7, "1", None, 0.5, np.float64(1.0)]


@pytest.mark.parametrize("rank", NOT_RANKS, ids=repr)
def test_a_rank_must_be_an_int(rank):
    partition = ExpertPartition(8, 2)
    for call in (partition.local_experts, partition.expert_map):
        with pytest.raises(TypeError, match=r"rank must be an int in \[0, 2\)"):
            call(rank)
    with pytest.raises(TypeError, match="rank must be an int"):
        LocalExperts.from_full_weights(WEIGHTS, partition, rank, cache_size=2, device="cpu")


@pytest.mark.parametrize("rank", [-1, 2, np.int64(2)], ids=repr)
def test_a_rank_outside_the_world_is_refused(rank):
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        ExpertPartition(8, 2).expert_map(rank)


def test_numpy_ranks_are_ranks():
    partition = ExpertPartition(8, 2)
    assert partition.local_experts(np.int64(1)) == (4, 5, 6, 7)
    assert LocalExperts.from_full_weights(WEIGHTS, partition, np.int32(1), cache_size=2, device="cpu").rank == 1


def test_a_partition_must_be_an_expert_partition():
    with pytest.raises(TypeError, match="partition must be an ExpertPartition"):
        LocalExperts.from_full_weights(WEIGHTS, (8, 1), 0, cache_size=2, device="cpu")
    with pytest.raises(TypeError, match="scheme must be a str"):
        ExpertPartition(8, 2, ["contiguous"])


# -- ExpertParallelMoE over a one-rank gloo group (findings 1, 2, 6, 8) -----------------------


@pytest.fixture(scope="module")
def one_rank_group():
    with process_group():
        yield


@pytest.fixture
def layer(one_rank_group):
    return ExpertParallelMoE(warm_rank())


def good_call():
    gen = torch.Generator().manual_seed(7)
    return torch.randn(3, HIDDEN, generator=gen), torch.rand(3, 2, generator=gen), IDS.clone()


def assert_layer_still_works(layer: ExpertParallelMoE) -> None:
    hidden, weights, ids = good_call()
    reference = moe_forward(hidden, WEIGHTS["w1"], WEIGHTS["w2"], weights, ids)
    assert torch.equal(layer(hidden, weights, ids), reference)


BAD_CALLS = [
    pytest.param(lambda h, w, i: (h[:, :15], w, i), ValueError, r"hidden must be \[T, H=16\]", id="H 15"),
    pytest.param(lambda h, w, i: (h.double(), w, i), TypeError, "weights' dtype torch.float32", id="hidden float64"),
    pytest.param(lambda h, w, i: (h.bfloat16(), w, i), TypeError, "weights' dtype torch.float32", id="hidden bf16"),
    pytest.param(lambda h, w, i: (h[:2], w, i), ValueError, "hidden has 2 rows but topk_ids 3", id="fewer rows"),
    pytest.param(lambda h, w, i: (h[0], w, i), ValueError, r"hidden must be \[T, H=16\]", id="hidden 1-D"),
    pytest.param(lambda h, w, i: (h, w.double(), i), TypeError, "topk_weights must be hidden's dtype", id="w f64"),
    pytest.param(lambda h, w, i: (h, w.long(), i), TypeError, "topk_weights must be hidden's dtype", id="w int64"),
    pytest.param(lambda h, w, i: (h, w.to("meta"), i), ValueError, "topk_weights is on meta", id="w on meta"),
    pytest.param(lambda h, w, i: (h, w.tolist(), i), TypeError, "topk_weights must be a tensor", id="w a list"),
    pytest.param(lambda h, w, i: (h, w.to_sparse(), i), TypeError, "topk_weights must be a dense", id="w sparse"),
    pytest.param(lambda h, w, i: (h, w, i.tolist()), TypeError, "topk_ids must be a tensor", id="ids a list"),
    pytest.param(lambda h, w, i: (h, w, i.short()), TypeError, "topk_ids must be int32 or int64", id="ids int16"),
    pytest.param(
        lambda h, w, i: (h, w, torch.tensor([[0, 9], [1, 2], [3, 4]])),
        IndexError,
        r"rank\(s\) \[0\] hold expert ids outside \[-1, 8\)",
        id="id 9",
    ),
]


@pytest.mark.parametrize("make_call, error, match", BAD_CALLS)
def test_layer_refuses_bad_input_before_the_cache_acts(layer, make_call, error, match):
    before = snapshot(layer)
    with pytest.raises(error, match=match):
        layer(*make_call(*good_call()))
    assert snapshot(layer) == before
    assert_layer_still_works(layer)


def test_layer_with_every_choice_skipped_loads_nothing(layer):
    stats, resident = snapshot(layer)
    hidden, weights, _ = good_call()
    assert torch.equal(layer(hidden, weights, torch.full((3, 2), -1)), torch.zeros(3, HIDDEN))
    assert layer.resident_experts() == resident
    assert (layer.stats.misses, layer.stats.evictions) == (stats.misses, stats.evictions)


def test_layer_takes_int32_ids_and_float32_router_weights_with_any_hidden(one_rank_group):
    hidden, weights, ids = good_call()
    layer = ExpertParallelMoE(warm_rank())
    reference = moe_forward(hidden, WEIGHTS["w1"], WEIGHTS["w2"], weights, ids)
    assert torch.equal(layer(hidden, weights, ids.int()), reference)
    weights64 = {name: t.double() for name, t in WEIGHTS.items()}
    layer64 = ExpertParallelMoE(
        LocalExperts.from_full_weights(weights64, ExpertPartition(8, 1), 0, cache_size=4, device="cpu")
    )
    reference64 = moe_forward(hidden.double(), weights64["w1"], weights64["w2"], weights, ids)
    assert torch.equal(layer64(hidden.double(), weights, ids), reference64)


def test_wrong_types_are_named(layer):
    with pytest.raises(TypeError, match=r"stats must be a CacheStats \(e.g. layer.stats\), got ExpertParallelMoE"):
        gather_stats(layer)
    with pytest.raises(TypeError, match="stats must be a CacheStats"):
        gather_stats(None)
    with pytest.raises(ValueError, match="unsupported device meta"):
        gather_stats(layer.stats, device="meta")
    with pytest.raises(TypeError, match="layer must be an ExpertParallelMoE, got LocalExperts"):
        rank_manifest(layer.local)
    with pytest.raises(TypeError, match="layer must be an ExpertParallelMoE, got NoneType"):
        gather_manifests(None)
    with pytest.raises(TypeError, match="local must be a LocalExperts"):
        ExpertParallelMoE(None)
    with pytest.raises(TypeError, match="pacing must be True or False"):
        ExpertParallelMoE(layer.local, pacing="yes")
    assert gather_stats(layer.stats).per_rank == (layer.stats,)


@pytest.mark.parametrize(
    "settings, error, match",
    [
        ({"world_size": "2"}, TypeError, "world_size must be an int"),
        ({"world_size": 2.5}, TypeError, "world_size must be an int"),
        ({"world_size": 0}, ValueError, "world_size must be >= 1"),
        ({"world_size": 2, "enabled": "no"}, TypeError, "enabled must be True or False"),
        ({"world_size": 2, "enabled": 1}, TypeError, "enabled must be True or False"),
    ],
)
def test_pacer_settings_are_checked(settings, error, match):
    with pytest.raises(error, match=match):
        CopyPacer(**settings)


# -- pacing belongs to its layer's call (finding 7) --------------------------------------------


class RunningWork:
    """A collective still in flight until waited for."""

    def __init__(self) -> None:
        self.waits = 0

    def is_completed(self) -> bool:
        return self.waits > 0

    def wait(self) -> bool:
        self.waits += 1
        return True


def test_a_pacer_routes_copies_only_while_its_call_runs():
    provider = CachedWeightProvider(random_weights(4, 8, 4), cache_size=1, device="cpu")
    pacer = CopyPacer(world_size=2, enabled=True, chunk_bytes=64)
    unpaced = provider.pool.copy_expert
    with pacer.pacing(provider.pool, RunningWork()):
        provider.prepare(torch.tensor([[0]]))
    assert pacer.stats.experts == 1 and pacer.stats.holds == 1
    assert provider.pool.copy_expert == unpaced
    with pytest.raises(RuntimeError, match="the call failed"), pacer.pacing(provider.pool, RunningWork()):
        raise RuntimeError("the call failed")
    assert provider.pool.copy_expert == unpaced
    provider.prepare(torch.tensor([[1]]))  # copied, not paced
    assert pacer.stats.experts == 1 and provider.stats.misses == 2


# -- two ranks: what only several ranks can get wrong (findings 3, 7) ---------------------------


def test_two_ranks_raise_alike_instead_of_aborting():
    run_ranks(check_two_ranks, 2, collective_timeout=timedelta(seconds=60))


def check_two_ranks(rank: int) -> None:
    partition = ExpertPartition(NUM_EXPERTS, 2)
    local = LocalExperts.from_full_weights(WEIGHTS, partition, rank, cache_size=2, device="cpu")
    layer = ExpertParallelMoE(local)
    gen = torch.Generator().manual_seed(11)
    hidden_all, weights_all = torch.randn(6, HIDDEN, generator=gen), torch.rand(6, 2, generator=gen)
    ids_all = torch.tensor([[0, 4], [1, 5], [2, 6], [3, 7], [0, 7], [1, 6]])
    reference = moe_forward(hidden_all, WEIGHTS["w1"], WEIGHTS["w2"], weights_all, ids_all)
    mine = slice(3 * rank, 3 * rank + 3)
    hidden, weights, ids = hidden_all[mine], weights_all[mine], ids_all[mine]
    # int32 ids on rank 0, int64 on rank 1: both accepted (gloo aborted on the gather before)
    assert torch.equal(layer(hidden, weights, ids.int() if rank == 0 else ids), reference[mine])
    before = snapshot(layer)
    with pytest.raises(ValueError, match="ranks disagree on top-k: K from 2 to 3"):
        wider = torch.cat([ids, ids[:, :1]], dim=1)
        layer(hidden, weights if rank == 0 else torch.rand(3, 3), ids if rank == 0 else wider)
    own = (TypeError, "hidden is torch.float64") if rank == 0 else (ValueError, r"rank\(s\) \[0\] refused their inputs")
    with pytest.raises(own[0], match=own[1]):  # one rank refused: the other raises too, no hang
        layer(hidden.double() if rank == 0 else hidden, weights, ids)
    bad = ids.clone()
    if rank == 1:
        bad[0, 0] = 8
    with pytest.raises(IndexError, match=r"topk_ids of rank\(s\) \[1\] hold expert ids outside \[-1, 8\)"):
        layer(hidden, weights, bad)
    assert snapshot(layer) == before
    assert torch.equal(layer(hidden, weights, ids), reference[mine])
    check_hidden_dtypes_across_ranks(rank, partition, hidden, weights, ids)
    check_pacing_belongs_to_its_layer(local, layer, hidden, weights, ids)
    check_summaries_refused_on_one_rank(rank, layer)


def check_hidden_dtypes_across_ranks(rank, partition, hidden, weights, ids) -> None:
    """Each rank's hidden fits its own weights, but rank 1's are float64: both raise."""
    dtype = torch.float32 if rank == 0 else torch.float64
    own = LocalExperts.from_full_weights(
        {n: t.to(dtype) for n, t in WEIGHTS.items()}, partition, rank, cache_size=2, device="cpu"
    )
    layer = ExpertParallelMoE(own)
    before = snapshot(layer)
    with pytest.raises(TypeError, match="ranks disagree on hidden's dtype: torch.float32 and torch.float64"):
        layer(hidden.to(dtype), weights, ids)
    assert snapshot(layer) == before


def check_pacing_belongs_to_its_layer(local, layer, hidden, weights, ids) -> None:
    """A paced layer built on ``local`` after ``layer`` paces its own calls, not ``layer``'s."""
    paced = ExpertParallelMoE(local, pacing=True, pacing_chunk_bytes=256)
    misses = local.stats.misses
    layer(hidden, weights, ids)  # each rank's 4 experts through 2 slots: misses every call
    assert local.stats.misses > misses and paced.pacer.stats == PacingStats()
    misses = local.stats.misses
    paced(hidden, weights, ids)
    assert paced.pacer.stats.experts == local.stats.misses - misses > 0


def check_summaries_refused_on_one_rank(rank: int, layer: ExpertParallelMoE) -> None:
    """A summary one rank refuses its arguments to: that rank raises its error, the other a
    ValueError naming it (it waited in the collective until the timeout before); the next
    good calls gather as ever."""
    refusals = [  # (the refusing rank, its error, the call's name, the call on each rank)
        (0, (TypeError, "stats must be a CacheStats"), "gather_stats",
         lambda bad: gather_stats(None if bad else layer.stats)),
        (1, (ValueError, "unsupported device meta"), "gather_stats",
         lambda bad: gather_stats(layer.stats, device="meta" if bad else "cpu")),
        (1, (TypeError, "layer must be an ExpertParallelMoE"), "gather_manifests",
         lambda bad: gather_manifests(layer.local if bad else layer)),
    ]  # fmt: skip
    for refusing, (error, message), name, call in refusals:
        if rank != refusing:
            error, message = ValueError, rf"rank\(s\) \[{refusing}\] refused their arguments to {name}"
        with pytest.raises(error, match=message):
            call(rank == refusing)
    gathered = gather_stats(layer.stats)
    assert len(gathered.per_rank) == 2 and gathered.per_rank[rank] == layer.stats
    assert [manifest["rank"] for manifest in gather_manifests(layer)] == [0, 1]
