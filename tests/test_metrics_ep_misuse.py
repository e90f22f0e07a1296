"""Misuse of the metrics and of expert parallelism: a clear error, and nothing changed.

* A tracked provider whose `CacheStats` holds something that is not a count (a str, None, a
  float, a negative number, a bool) is refused by `CacheCollector.track`; one whose counters
  turn bad later is left out of that scrape (counted in ``stats_read_errors``), instead of
  failing the whole scrape or serving a counter that goes backwards.
* A paused collector freezes the prepare-time histogram with the counters, so one scrape
  never shows more timed prepares than ``prepare_calls_total``.
* `ExpertParallelMoE` refuses ``topk_ids`` with no choice per token (K = 0) before the cache
  counts a call, instead of an IndexError from the combine afterwards.
* `gather_stats` refuses counters that are not int64 counts (1.5 was truncated to 1, -1 sent
  as is), and on two ranks the refusing rank still joins the gather: both raise, none waits.
* Two ranks whose layers place the experts differently (another ``num_experts`` or scheme)
  both raise one ValueError before any data moves, instead of wrong outputs on one rank or
  an IndexError on one rank while the other waits in the all-to-all.

The two-rank checks run in two spawned processes over gloo, with a short collective timeout.
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
from helpers import random_weights
from process_groups import process_group, run_ranks
from prometheus_client import CollectorRegistry, generate_latest

from expertcache import CachedWeightProvider
from expertcache.metrics import CacheCollector, TimedProvider
from expertcache.parallel import ExpertParallelMoE, ExpertPartition, LocalExperts, gather_stats
from expertcache.reference import moe_forward
from expertcache.stats import CacheStats

NUM_EXPERTS, HIDDEN, INTER = 8, 16, 8
WEIGHTS = random_weights(NUM_EXPERTS, HIDDEN, INTER, generator=torch.Generator().manual_seed(0))


class FixedStats:
    """A tracked object whose ``stats`` is whatever the test sets."""

    def __init__(self, stats: object) -> None:
        self.stats = stats


def _provider() -> CachedWeightProvider:
    provider = CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, device="cpu")
    provider.prepare(torch.tensor([[0, 1]]))
    return provider


def _samples(registry: CollectorRegistry, name: str) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if line.startswith(name)]


NOT_COUNTS = [
    pytest.param(CacheStats(hits="3"), TypeError, id="a str"),
    pytest.param(CacheStats(misses=None), TypeError, id="None"),
    pytest.param(CacheStats(hits=1.5), TypeError, id="a float"),
    pytest.param(CacheStats(evictions=True), TypeError, id="a bool"),
    pytest.param(CacheStats(calls=-1), ValueError, id="negative"),
]


@pytest.mark.parametrize("stats, error", NOT_COUNTS)
def test_stats_whose_counters_are_not_counts_are_refused_when_tracked(stats, error):
    collector = CacheCollector({"0": _provider()})
    registry = CollectorRegistry()
    registry.register(collector)
    before = _samples(registry, "expertcache_")
    with pytest.raises(error, match="layer 'bad' has a CacheStats whose .* must be"):
        collector.track("bad", FixedStats(stats))
    assert _samples(registry, "expertcache_") == before  # nothing tracked, nothing counted


@pytest.mark.parametrize("stats, error", NOT_COUNTS)
def test_counters_that_turn_bad_leave_the_layer_out_not_the_scrape(stats, error):
    turning = FixedStats(CacheStats(hits=2))
    registry = CollectorRegistry()
    registry.register(CacheCollector({"0": _provider(), "turning": turning}))
    turning.stats = stats
    text = generate_latest(registry).decode()  # the scrape itself must not raise
    assert 'expertcache_hits_total{layer="0"} 0.0' in text  # the other layer is served
    turning_lines = [line for line in text.splitlines() if 'layer="turning"' in line]
    assert turning_lines == ['expertcache_stats_read_errors_total{layer="turning"} 1.0']


def test_a_paused_collector_freezes_the_prepare_time_histogram_too():
    timed = TimedProvider(CachedWeightProvider(random_weights(6, 8, 4), cache_size=3, device="cpu"))
    timed.prepare(torch.tensor([[0, 1]]))
    registry = CollectorRegistry()
    collector = CacheCollector({"7": timed})
    registry.register(collector)
    with collector.paused():
        timed.prepare(torch.tensor([[0, 1]]))
        calls = _samples(registry, "expertcache_prepare_calls_total")
        count = _samples(registry, "expertcache_prepare_seconds_count")
    assert calls == ['expertcache_prepare_calls_total{layer="7"} 1.0']
    assert count == ['expertcache_prepare_seconds_count{layer="7"} 1.0']  # not 2: one scrape, one moment
    after = _samples(registry, "expertcache_prepare_seconds_count")
    assert after == ['expertcache_prepare_seconds_count{layer="7"} 2.0']


# -- expert parallelism in this process: a one-rank gloo group ----------------------------------


@pytest.fixture(scope="module")
def one_rank_group():
    with process_group():
        yield


def _layer() -> ExpertParallelMoE:
    partition = ExpertPartition(NUM_EXPERTS, 1)
    return ExpertParallelMoE(LocalExperts.from_full_weights(WEIGHTS, partition, 0, cache_size=4, device="cpu"))


def test_top_k_of_zero_is_refused_before_the_cache_counts_a_call(one_rank_group):
    layer = _layer()
    hidden = torch.randn(3, HIDDEN)
    before = layer.stats, layer.resident_experts()
    with pytest.raises(ValueError, match=r"topk_ids must hold at least one choice per token \(K >= 1\)"):
        layer(hidden, torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.int64))
    assert (layer.stats, layer.resident_experts()) == before
    weights, ids = torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 5]])
    assert torch.equal(layer(hidden, weights, ids), moe_forward(hidden, WEIGHTS["w1"], WEIGHTS["w2"], weights, ids))


@pytest.mark.parametrize(
    "stats, error, match",
    [
        pytest.param(CacheStats(hits=1.5), TypeError, "hits must be an int", id="a float, truncated before"),
        pytest.param(CacheStats(calls=-1), ValueError, "calls must be >= 0", id="negative"),
        pytest.param(CacheStats(misses=2**63), ValueError, "misses must be <=", id="beyond int64"),
    ],
)
def test_gather_stats_refuses_counters_that_are_not_int64_counts(one_rank_group, stats, error, match):
    with pytest.raises(error, match=match):
        gather_stats(stats)
    assert gather_stats(CacheStats(hits=3)).per_rank == (CacheStats(hits=3),)


# -- two ranks, two processes -------------------------------------------------------------------


def test_two_ranks_that_disagree_raise_alike_and_none_waits():
    run_ranks(_check_two_ranks, 2, collective_timeout=timedelta(seconds=20))


def _check_two_ranks(rank: int) -> None:
    _check_partitions_disagree(rank)
    _check_gather_stats_refused_on_one_rank(rank)


def _check_partitions_disagree(rank: int) -> None:
    """Rank 0 places 8 experts, rank 1 ten (id 9 is valid only there); then rank 1 deals them
    round robin while rank 0 keeps blocks. Both ranks raise the same ValueError each time."""
    weights = random_weights(10, HIDDEN, INTER, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    hidden, router = torch.randn(2, HIDDEN, generator=gen), torch.rand(2, 2, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3]]) if rank == 0 else torch.tensor([[4, 5], [6, 9]])
    experts = 8 if rank == 0 else 10
    partitions = [
        (ExpertPartition(experts, 2), "num_experts from 8 to 10"),
        (ExpertPartition(10, 2, "contiguous" if rank == 0 else "round_robin"), "scheme"),
    ]
    for partition, what in partitions:
        mine = {name: tensor[: partition.num_experts] for name, tensor in weights.items()}
        layer = ExpertParallelMoE(LocalExperts.from_full_weights(mine, partition, rank, cache_size=2, device="cpu"))
        before = layer.stats, layer.resident_experts()
        with pytest.raises(ValueError, match=f"ranks disagree on the expert partition: {what}"):
            layer(hidden, router, ids)
        assert (layer.stats, layer.resident_experts()) == before
    agreed = ExpertPartition(10, 2)
    layer = ExpertParallelMoE(LocalExperts.from_full_weights(weights, agreed, rank, cache_size=2, device="cpu"))
    all_ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 9]])
    all_hidden = torch.cat([hidden] * 2)  # the same draw on both ranks
    all_router = torch.cat([router] * 2)
    reference = moe_forward(all_hidden, weights["w1"], weights["w2"], all_router, all_ids)
    assert torch.equal(layer(hidden, router, ids), reference[2 * rank : 2 * rank + 2])


def _check_gather_stats_refused_on_one_rank(rank: int) -> None:
    """Rank 0's counters are a str: it raises its TypeError, rank 1 a ValueError naming it."""
    stats = CacheStats(hits="3") if rank == 0 else CacheStats(hits=3)
    error, match = (
        (TypeError, "hits must be an int") if rank == 0 else (ValueError, r"rank\(s\) \[0\] refused their arguments")
    )
    with pytest.raises(error, match=match):
        gather_stats(stats)
    gathered = gather_stats(CacheStats(hits=rank + 1))
    assert gathered.total.hits == 3 and math.isfinite(gathered.total.hit_rate)
