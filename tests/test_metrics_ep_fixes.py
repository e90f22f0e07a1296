"""Defects of the metrics and of expert parallelism found by a review, each reproduced here.

* A scrape that reads `TimedProvider`'s prepare-time histogram while a ``prepare`` records
  its time never sees a sum that disagrees with the buckets and the count. The writer is
  traced and paused before each of its lines in `expertcache.timed_provider` (between the
  bucket's update and the sum's among them), and a real scrape runs at every pause.
* The counters ``invalid_ids`` and ``overflows`` of `CacheStats` are exported, with help
  text saying what they count (``invalid_ids`` from a real device-mode cache).
* An `ExpertParallelMoE` call in which no rank has a token is a call: every rank counts it,
  as `LocalExperts` counts an empty call, and as the layer counts a call in which only this
  rank has none.
* `gather_manifests` on a rank that hits any error (not only a TypeError) while building its
  manifest: that rank raises its error, every other rank one ValueError naming it, none
  waits; the next gather pairs as ever.

The two-rank checks run in two spawned processes over gloo, with a short collective timeout
and a deadline on the whole spawn, so a rank left waiting fails the test instead of hanging.
"""

from __future__ import annotations

import dataclasses
import queue
import re
import sys
import threading
from datetime import timedelta

import pytest
import torch
from conftest import devices
from helpers import random_weights
from process_groups import run_ranks
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import expertcache.timed_provider
from expertcache import CachedWeightProvider
from expertcache.metrics import CacheCollector, TimedProvider
from expertcache.parallel import ExpertParallelMoE, ExpertPartition, LocalExperts, gather_manifests
from expertcache.stats import CacheStats

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 16, 8
DEADLINE_S = 180.0  # the whole two-rank spawn; a collective gives up after COLLECTIVE_TIMEOUT
COLLECTIVE_TIMEOUT = timedelta(seconds=20)


def _families(registry: CollectorRegistry) -> dict:
    return {family.name: family for family in text_string_to_metric_families(generate_latest(registry).decode())}


# -- 1. the prepare-time histogram: sum, buckets and count from one moment ----------------------


def _pausing_tracer(filename: str, pauses: queue.Queue):
    """A `sys.settrace` function that stops before every line run in ``filename``: it hands
    the test an event and waits until the test sets it."""

    def line_tracer(frame, event, arg):
        if event == "line":
            resume = threading.Event()
            pauses.put(resume)
            if not resume.wait(timeout=DEADLINE_S):
                raise RuntimeError("the test never resumed the traced prepare")
        return line_tracer

    def call_tracer(frame, event, arg):
        return line_tracer if frame.f_code.co_filename == filename else None

    return call_tracer


def _histogram(registry: CollectorRegistry) -> tuple[list[tuple[float, float]], float, float]:
    """One scrape's ``expertcache_prepare_seconds``: cumulative (bound, count) buckets, count, sum."""
    family = _families(registry)["expertcache_prepare_seconds"]
    values = {sample.name: sample.value for sample in family.samples if not sample.name.endswith("_bucket")}
    buckets = [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
    return buckets, values["expertcache_prepare_seconds_count"], values["expertcache_prepare_seconds_sum"]


def _agrees(buckets: list[tuple[float, float]], count: float, total: float) -> bool:
    """Whether a histogram of at most one observation is self-consistent: none and a sum of
    0, or one whose sum (that observation, > 0) lies in the bucket that counted it."""
    if count == 0:
        return total == 0.0 and all(cumulative == 0 for _, cumulative in buckets)
    lower = 0.0
    for bound, cumulative in buckets:
        if cumulative == 1:
            return count == 1 and lower < total <= bound
        lower = bound
    return False


def test_a_scrape_never_sees_a_sum_that_disagrees_with_the_buckets():
    timed = TimedProvider(CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, device="cpu"))
    registry = CollectorRegistry()
    registry.register(CacheCollector({"0": timed}))
    pauses: queue.Queue = queue.Queue()
    failures: list[BaseException] = []

    def traced_prepare() -> None:
        sys.settrace(_pausing_tracer(expertcache.timed_provider.__file__, pauses))
        try:
            timed.prepare(torch.tensor([[0, 1]]))
        except BaseException as error:
            failures.append(error)
        finally:
            sys.settrace(None)
            pauses.put(None)

    scrapes: list[tuple] = []

    def scrape() -> None:
        scrapes.append(_histogram(registry))

    writer = threading.Thread(target=traced_prepare)
    writer.start()
    readers = []
    while (resume := pauses.get(timeout=DEADLINE_S)) is not None:
        reader = threading.Thread(target=scrape)
        reader.start()
        reader.join(timeout=1.0)  # a scrape that waits for the writer's update finishes after it
        readers.append(reader)
        resume.set()
    writer.join(timeout=DEADLINE_S)
    for reader in readers:
        reader.join(timeout=DEADLINE_S)
    assert not failures and not writer.is_alive() and not any(reader.is_alive() for reader in readers)
    assert len(readers) >= 3  # the writer really was stopped inside prepare and its update
    scrapes.append(_histogram(registry))
    assert len(scrapes) == len(readers) + 1
    assert scrapes[-1][1] == 1  # the prepare was recorded
    disagreeing = [(count, total) for buckets, count, total in scrapes if not _agrees(buckets, count, total)]
    assert disagreeing == []


def test_the_histogram_still_counts_every_prepare_and_pass():
    timed = TimedProvider(CachedWeightProvider(random_weights(6, 8, 4), cache_size=2, device="cpu"))
    timed.prepare(torch.tensor([[0, 1]]))
    passes = list(timed.passes(torch.tensor([[2, 3], [4, 5]])))  # 4 experts through 2 slots: 2 passes
    buckets, total = timed.prepare_seconds()
    assert len(passes) == 2 and buckets[-1] == ("+Inf", 3) and total > 0
    assert [bound for bound, _ in buckets[:-1]] == [str(bound) for bound in timed.buckets]


# -- 2. invalid_ids and overflows exported -----------------------------------------------------


class FixedStats:
    """A tracked object whose ``stats`` is whatever the test sets (anything with ``stats``
    is tracked: a model's layers, a wrapper)."""

    def __init__(self, stats: CacheStats) -> None:
        self.stats = stats


@pytest.mark.parametrize("device", devices())
def test_invalid_ids_and_overflows_are_exported_with_their_help(device):
    provider = CachedWeightProvider(random_weights(4, 8, 4), cache_size=2, device=device, mode="device")
    provider.prepare(torch.tensor([[1, 7]], device=device))  # 7 is outside [0, 4): -1, counted
    assert provider.stats.invalid_ids == 1
    registry = CollectorRegistry()
    registry.register(CacheCollector({"device": provider, "fixed": FixedStats(CacheStats(invalid_ids=5, overflows=3))}))
    families = _families(registry)
    expected = {
        "expertcache_invalid_ids": ({"device": 1.0, "fixed": 5.0}, "outside [0, E)"),
        "expertcache_overflows": ({"device": 0.0, "fixed": 3.0}, "more distinct experts than slots"),
    }
    for name, (values, said) in expected.items():
        assert name in families, f"{name} is not exported"
        family = families[name]
        assert family.type == "counter" and said in family.documentation
        totals = {sample.labels["layer"]: sample.value for sample in family.samples if sample.name == f"{name}_total"}
        assert totals == values


# -- two ranks, two processes -------------------------------------------------------------------


def _spawn_two_ranks(check) -> None:
    """Run ``check(rank)`` on two gloo ranks; a rank left waiting in a collective fails the
    test at the deadline instead of hanging it."""
    run_ranks(check, 2, timeout=DEADLINE_S, collective_timeout=COLLECTIVE_TIMEOUT)


def _layer(rank: int, cls: type[ExpertParallelMoE] = ExpertParallelMoE) -> ExpertParallelMoE:
    weights = random_weights(NUM_EXPERTS, HIDDEN, INTER, generator=torch.Generator().manual_seed(0))
    partition = ExpertPartition(NUM_EXPERTS, 2)
    return cls(LocalExperts.from_full_weights(weights, partition, rank, cache_size=2, device="cpu"))


# -- 3. a call is a call, even when no rank has a token -----------------------------------------


def test_a_call_with_no_token_on_any_rank_is_counted_on_every_rank():
    _spawn_two_ranks(_check_empty_calls_are_counted)


def _check_empty_calls_are_counted(rank: int) -> None:
    layer = _layer(rank)
    empty_hidden, empty_ids = torch.empty(0, HIDDEN), torch.empty(0, TOP_K, dtype=torch.int64)
    calls = layer.local.stats.calls
    layer.local.outputs(empty_hidden, empty_ids)  # what LocalExperts does with an empty call
    assert layer.local.stats.calls == calls + 1
    gen = torch.Generator().manual_seed(3)
    hidden, router = torch.randn(2, HIDDEN, generator=gen), torch.rand(2, TOP_K, generator=gen)
    tokens = torch.tensor([[0, 5], [3, 6]])
    skipped = torch.full((2, TOP_K), -1)
    steps = [  # (rows of rank 0, rows of rank 1, ids): what a step brings
        (0, 0, tokens),  # no token on any rank: the call this test is about
        (0, 2, tokens),  # only rank 1 has tokens
        (2, 0, tokens),  # only rank 0
        (2, 2, skipped),  # tokens everywhere, every choice skipped: nothing to look up
        (0, 0, tokens),  # and again, after calls that copied experts
    ]
    for rows0, rows1, ids in steps:
        rows = rows0 if rank == 0 else rows1
        before = layer.stats
        out = layer(hidden[:rows], router[:rows], ids[:rows])
        after = layer.stats
        assert out.shape == (rows, HIDDEN)
        assert after.calls == before.calls + 1, f"step {rows0, rows1} counted {after.calls - before.calls} calls"
        if rows0 == rows1 == 0 or ids is skipped:  # nothing looked up, copied or evicted
            assert after == dataclasses.replace(before, calls=before.calls + 1)


# -- 4. gather_manifests: any error on one rank, the same error everywhere else -------------------


class FailingLayer(ExpertParallelMoE):
    """A layer whose resident set cannot be read (a failure injected into what
    `rank_manifest` reads, as a broken provider would raise)."""

    error: Exception | None = None

    def resident_experts(self) -> frozenset[int]:
        if self.error is not None:
            raise self.error
        return super().resident_experts()


def test_gather_manifests_shares_any_error_of_one_rank_and_none_waits():
    _spawn_two_ranks(_check_gather_manifests_errors)


def _check_gather_manifests_errors(rank: int) -> None:
    layer = _layer(rank, FailingLayer)
    assert isinstance(layer, FailingLayer)
    layer(torch.randn(1, HIDDEN), torch.rand(1, TOP_K), torch.tensor([[rank, 4 + rank]]))
    failures = [  # {rank: the error it hits}: every other rank raises one ValueError naming them
        {0: ValueError("the slot table is not readable")},
        {1: RuntimeError("device lost")},
        {0: IndexError("expert 9 outside [0, 8)")},
        {1: KeyError("w1")},
        {0: ValueError("rank 0's own"), 1: OSError("rank 1's own")},
    ]
    for failing in failures:
        layer.error = failing.get(rank)
        if layer.error is not None:
            with pytest.raises(type(layer.error)) as raised:
                gather_manifests(layer)
            assert raised.value is layer.error  # its own error, not a copy
        else:
            ranks = sorted(failing)
            (failed,) = failing.values()
            name = type(failed).__name__
            said = re.escape(f"rank(s) {ranks} failed in gather_manifests (rank {ranks[0]}: {name}: {failed}); ")
            match = said + "nothing was gathered"
            with pytest.raises(ValueError, match=match):
                gather_manifests(layer)
    layer.error = None  # the ranks still pair their gathers
    manifests = gather_manifests(layer)
    assert [manifest["rank"] for manifest in manifests] == [0, 1]
    assert manifests[rank]["resident"] == sorted(layer.resident_experts())
