"""Three findings in the generator, the resident provider and expert parallelism.

1. ``GraphedGenerator(graphs="auto", warmup_steps=N)`` where "auto" runs eagerly (a CPU, a
   host-mode cache): the warm-up was dropped without a word. Now one warning names the
   setting and why nothing is captured (``graphs=False`` with it stays refused).
2. `FullGPUProvider`: ids it does not read on the host (on a GPU, or under
   ``torch.compile``) went into the result unchanged without an ``expert_map``, so an id
   outside ``[0, E)`` reached the kernel as an index past ``w1`` (with a map it came out
   -1). Now both go through the one global -> local table and come out -1, as a
   device-mode cache's do; and ``passes`` refuses bad ids when called, as a cache's does.
3. `ExpertParallelMoE`: an error after the cache served a call (in the exchange, in the
   combine, in the compute after a pass was committed) leaves the cache's commits; the next
   call of every rank still equals the single-process reference (gloo, two processes). (A
   rank failing alone before the all-to-all leaves the others waiting in it: the group's
   collectives are out of step, which no layer can mend; the layer's docstring says so.)
"""

from __future__ import annotations

import contextlib
import warnings
from datetime import timedelta

import pytest
import torch
from helpers import random_weights
from process_groups import run_ranks
from transformers_helpers import TINY, tiny_model

import expertcache.parallel.layer as layer_module
import expertcache.parallel.local as local_module
from expertcache import FullGPUProvider
from expertcache.integrations.transformers import enable_expert_cache
from expertcache.integrations.transformers.graphed import GraphedGenerator
from expertcache.kernels import moe_apply_torch
from expertcache.parallel import ExpertParallelMoE, ExpertPartition, LocalExperts
from expertcache.reference import moe_forward

MAX_LENGTH, NEW = 24, 6

# -- 1. graphs="auto" that runs eagerly says it drops warmup_steps ------------------------------


def _prompt() -> torch.Tensor:
    return torch.randint(0, TINY.vocab, (1, 8), generator=torch.Generator().manual_seed(3))


def test_auto_that_runs_eagerly_warns_once_that_warmup_steps_has_no_effect():
    model = tiny_model("qwen3_moe")
    expected = GraphedGenerator(model, max_length=MAX_LENGTH).generate(_prompt(), max_new_tokens=NEW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = GraphedGenerator(model, max_length=MAX_LENGTH, graphs="auto", warmup_steps=5)
        tokens = runner.generate(_prompt(), max_new_tokens=NEW)
        runner.generate(_prompt(), max_new_tokens=NEW)
    messages = [str(warning.message) for warning in caught if issubclass(warning.category, UserWarning)]
    assert len(messages) == 1, messages  # at construction, not per request
    assert "warmup_steps=5 has no effect" in messages[0] and "graphs='auto' runs the decode step eagerly" in messages[0]
    assert "the model is on cpu" in messages[0]
    assert caught[0].filename == __file__  # points at the caller's line
    assert not runner.graphs and not runner.captured_buckets
    assert torch.equal(tokens, expected)  # control: the eager path serves as without the setting


def test_auto_names_every_reason_it_runs_eagerly():
    model = tiny_model("olmoe")
    handle = enable_expert_cache(model, cache_size=4, mode="host")
    with pytest.warns(UserWarning, match="warmup_steps=3 has no effect") as caught:
        GraphedGenerator(model, max_length=MAX_LENGTH, warmup_steps=3)
    message = str(caught[0].message)
    assert "the model is on cpu" in message and "a host-mode expert cache reads routing ids" in message
    handle.disable()


def test_auto_with_the_default_warmup_and_graphs_false_with_a_warmup_are_unchanged():
    model = tiny_model("qwen3_moe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing was asked for that is dropped: no warning
        assert GraphedGenerator(model, max_length=MAX_LENGTH).warmup_steps == 2
        assert not GraphedGenerator(model, max_length=MAX_LENGTH, graphs=False).graphs
    with pytest.raises(ValueError, match="warmup_steps=5 given with graphs=False"):
        GraphedGenerator(model, max_length=MAX_LENGTH, graphs=False, warmup_steps=5)
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):  # checked before the warning
        GraphedGenerator(model, max_length=MAX_LENGTH, warmup_steps=0)


# -- 2. FullGPUProvider: ids it does not read come out -1, bad ids refused when passes is called -


EXPERTS, HIDDEN, INTER = 6, 16, 8
WEIGHTS = random_weights(EXPERTS, HIDDEN, INTER, generator=torch.Generator().manual_seed(5))
IDENTITY = torch.arange(EXPERTS, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_compiled_full_provider_maps_ids_it_cannot_read_to_minus_one(dtype):
    """Under torch.compile the ids are not read on the host (as on a GPU): through a map
    (here the identity) E, -1 and ``2**32 + 3`` (3 if narrowed) come out -1, as a
    device-mode cache's do, never an index past ``w1``. (Without a map they reach the
    kernel unchanged, at no cost: `FullGPUProvider`'s docstring.)"""
    torch._dynamo.reset()
    provider = FullGPUProvider(WEIGHTS, expert_map=IDENTITY)
    compiled = torch.compile(lambda ids: provider.prepare(ids).topk_ids, backend="eager", fullgraph=True)
    wide = 2**32 + 3 if dtype == torch.int64 else 3  # int32 holds no such id: a valid one instead
    ids = torch.tensor([[0, EXPERTS], [-1, 5], [wide, 2]], dtype=dtype)
    expected = [[0, -1], [-1, 5], [-1 if dtype == torch.int64 else 3, 2]]
    out = compiled(ids)
    assert out.dtype == dtype and out.tolist() == expected
    good = torch.tensor([[1, 4], [5, 0]], dtype=dtype)
    assert torch.equal(compiled(good), good)  # control: valid ids are themselves


def test_full_provider_passes_refuse_bad_ids_when_called():
    """A cache's ``passes`` refuses bad ids when called (`TimedProvider` relies on it); the
    resident provider's refused them only once its first pass was taken."""
    provider = FullGPUProvider(WEIGHTS)
    bad = {
        "float": (torch.tensor([[0.0, 1.0]]), TypeError, "int32 or int64"),
        "1-D": (torch.tensor([0, 1]), ValueError, r"2-D \[T, K\]"),
        "a list": ([[0, 1]], TypeError, "must be a tensor"),
        "another device": (torch.tensor([[0, 1]], device="meta"), ValueError, "is on meta"),
        "id E": (torch.tensor([[0, EXPERTS]]), IndexError, rf"expert id {EXPERTS} in topk_ids is outside"),
        "id -1": (torch.tensor([[-1, 2]]), IndexError, r"expert id -1 in topk_ids is outside \[0, 6\)"),
    }
    for name, (ids, error, match) in bad.items():
        with pytest.raises(error, match=match):
            provider.passes(ids)
            pytest.fail(f"{name}: passes() returned")
    ids = torch.tensor([[0, 5], [3, 1]])
    (result,) = provider.passes(ids, overlap=True, landing=True)  # control: one pass, no counters
    assert result.w1 is WEIGHTS["w1"] and torch.equal(result.topk_ids, ids) and result.landing is None


@pytest.mark.gpu
def test_gpu_ids_outside_the_experts_come_out_minus_one_through_a_map():
    weights = {name: tensor.cuda() for name, tensor in WEIGHTS.items()}
    provider = FullGPUProvider(weights, expert_map=IDENTITY.cuda())
    ids = torch.tensor([[0, EXPERTS], [2**32 + 3, 5]], device="cuda")
    result = provider.prepare(ids)
    assert result.topk_ids.tolist() == [[0, -1], [-1, 5]]
    hidden, router = torch.randn(2, HIDDEN, device="cuda"), torch.rand(2, 2, device="cuda")
    skipped = torch.tensor([[0, -1], [-1, 5]], device="cuda")
    expected = moe_apply_torch(hidden, weights["w1"], weights["w2"], router, skipped)
    torch.testing.assert_close(moe_apply_torch(hidden, result.w1, result.w2, router, result.topk_ids), expected)


# -- 3. expert parallelism: an error after the cache served the call ----------------------------

EP_EXPERTS = 8  # two ranks own 0..3 and 4..7
EP_WEIGHTS = random_weights(EP_EXPERTS, HIDDEN, INTER, generator=torch.Generator().manual_seed(9))
FIRST = torch.tensor([[0, 4], [1, 5], [0, 5], [1, 4]])  # each rank's two slots: 0, 1 | 4, 5
SECOND = torch.tensor([[2, 6], [3, 7], [2, 7], [3, 6]])  # evicts all of them: 2, 3 | 6, 7


def test_an_error_after_the_cache_served_leaves_a_layer_that_still_equals_the_reference():
    run_ranks(check_ep_rank, 2, collective_timeout=timedelta(seconds=60))


def check_ep_rank(rank: int) -> None:
    for pacing in (False, True):
        for where, failing in (("exchange", (0, 1)), ("combine", (1,)), ("compute", (0, 1))):
            check_error_after_serving(rank, where, failing, pacing)


@contextlib.contextmanager
def broken(where: str, fails: bool):
    """Make this rank's ``where`` step raise once the cache has served the call: the
    all-to-all of the outputs (before it is issued, as memory running out would), the
    weighted sum after it, or the experts' compute after the first pass was committed."""
    module, name = {
        "exchange": (layer_module, "exchange_rows"),
        "combine": (layer_module, "combine_expert_outputs"),
        "compute": (local_module, "expert_outputs"),
    }[where]
    original = getattr(module, name)

    def fail(*args, **kwargs):
        raise RuntimeError(f"injected failure in {where}")

    setattr(module, name, fail if fails else original)
    try:
        yield
    finally:
        setattr(module, name, original)


def check_error_after_serving(rank: int, where: str, failing: tuple[int, ...], pacing: bool) -> None:
    partition = ExpertPartition(EP_EXPERTS, 2)
    local = LocalExperts.from_full_weights(EP_WEIGHTS, partition, rank, cache_size=2, device="cpu")
    layer = ExpertParallelMoE(local, pacing=pacing, pacing_chunk_bytes=256)
    gen = torch.Generator().manual_seed(13)
    hidden, router = torch.randn(8, HIDDEN, generator=gen), torch.rand(8, 2, generator=gen)
    mine = slice(4 * rank, 4 * rank + 4)  # rank r's tokens; every rank routes its 4 alike

    def call(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reference rows of this rank, ids of this rank)`` for a call of ``ids`` on every rank."""
        every = torch.cat([ids, ids])
        return moe_forward(hidden, EP_WEIGHTS["w1"], EP_WEIGHTS["w2"], router, every)[mine], every[mine]

    (first_reference, first), (second_reference, second) = call(FIRST), call(SECOND)
    assert torch.equal(layer(hidden[mine], router[mine], first), first_reference)
    before = layer.stats
    fails = rank in failing
    with broken(where, fails):
        if fails:
            with pytest.raises(RuntimeError, match=f"injected failure in {where}"):
                layer(hidden[mine], router[mine], second)
        else:  # its all-to-all completed: this rank's outputs are whole
            assert torch.equal(layer(hidden[mine], router[mine], second), second_reference)
    assert local.provider.pool.copy_expert != layer.pacer.copy  # the pacer let go of the pool
    assert layer.pacer.stats.experts == (4 if pacing else 0)  # both calls' copies went through it
    served = layer.stats  # the failed call's commits stay: its experts were copied and are resident
    assert (served.calls, served.misses) == (before.calls + 1, before.misses + 2)
    assert layer.resident_experts() == set(partition.local_experts(rank)[2:])
    out = layer(hidden[mine], router[mine], second)  # the same call again: its experts hit
    assert torch.equal(out, second_reference), (where, pacing)
    assert layer.stats.misses == served.misses and layer.stats.hits == served.hits + 2
    assert torch.equal(layer(hidden[mine], router[mine], first), first_reference)
