"""The simulator copies what the runtime copies, on every real trace in ``../shared/traces``.

Each trace (as recorded, and batched: ``B`` consecutive forward passes as one call, which
makes calls larger than the cache) runs through host-mode `CachedWeightProvider` pools
(per layer, and one pool shared by several layers) and through `expertcache.sim`; hits,
misses and evictions must be equal. Calls larger than the slots run in expert-group passes
in both (`expertcache.passes`), and so do overlapped passes (``passes(ids, overlap=True)``
against ``oversize="overlapped"``, for every call and, as `DecodeStack` asks, for the calls
of at most ``overlap_max_ids`` ids). Tiny expert tensors keep it fast: only the decisions are
compared. Device mode makes host mode's LRU decisions (`tests/test_device_mode.py`), and
on a GPU it is run here as well.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import real_traces

from expertcache import CachedWeightProvider, SlotPool
from expertcache.kernels import _launch
from expertcache.sim import replay_streams, trace_calls
from expertcache.trace import RoutingTrace, load_trace

TRACES = real_traces()
MIXTRAL = "mixtral-8x7b-instruct-fp8__speculative-moe"
FILES = [
    "olmoe-1b-7b-0924__cerebras-assesment2",
    "qwen1.5-moe-a2.7b-chat-gptq-int4__vllm-expert-profiler",
    "qwen3-30b-a3b-instruct-2507__local-moe-inference-stack",
    f"{MIXTRAL}/gsm8k_2_routing.jsonl",
    f"{MIXTRAL}/humaneval_2_routing.jsonl",
    f"{MIXTRAL}/routing_raw.jsonl",
]
MAX_FORWARDS, MAX_LAYERS = 120, 3  # enough to fill and churn every cache, quick on a CPU

pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason="no real routing traces (../shared/traces)")


@pytest.fixture(autouse=True)
def _host_tables_in_torch(monkeypatch):
    """Host mode's CPU tables take the kernels' torch references, as they do without
    ``TRITON_INTERPRET`` (and on a GPU machine): the decisions compared here are the policy's
    and the simulator's, and `tests/test_kernel_references.py` holds each kernel to its
    reference. Interpreted, a call's commit took ~25 ms and this file ~10 CPU minutes."""
    monkeypatch.setattr(_launch, "_KERNEL_DEVICE", "cuda")


def _head(trace: RoutingTrace, *, batch: int) -> RoutingTrace:
    """The first forward passes and layers, ``batch`` consecutive passes merged into one."""
    starts = trace.forward_starts[::batch][:MAX_FORWARDS]
    end = int(trace.forward_starts[len(starts) * batch]) if len(starts) * batch < len(trace.forward_starts) else None
    layers = None if trace.layers is None else trace.layers[:MAX_LAYERS]
    return dataclasses.replace(
        trace, expert_ids=trace.expert_ids[:end, :MAX_LAYERS], forward_starts=starts, layers=layers,
        request_starts=np.zeros(0, dtype=np.int64),
    )  # fmt: skip


def _runtime_ids(ids: np.ndarray, device: str) -> torch.Tensor | None:
    """A call's ids for the provider: entries without a record take an id of their own row
    (it adds no key, as the simulator drops them); None when nothing is left."""
    if ids.size == 0:
        return None
    filled = np.where(ids >= 0, ids, ids.max(axis=1, keepdims=True))
    return torch.from_numpy(filled.astype(np.int64)).to(device)


def _run(
    trace: RoutingTrace,
    *,
    slots: int,
    policy: str,
    scope: str,
    mode: str,
    device: str,
    overlap: bool = False,
    overlap_max_ids: int | None = None,
) -> tuple:
    columns = range(trace.num_layers)
    weights = {"w1": torch.zeros(trace.num_experts, 2, 1), "w2": torch.zeros(trace.num_experts, 1, 1)}
    if scope == "layer":
        providers = [
            CachedWeightProvider(weights, cache_size=slots, policy=policy, mode=mode, device=device) for _ in columns
        ]
    else:
        pool = SlotPool.for_weights(weights, slots, policy=policy, mode=mode, device=device)
        providers = [CachedWeightProvider(weights, pool=pool, layer=column) for column in columns]
    for forward in zip(*(trace.calls(column) for column in columns), strict=True):
        for provider, ids in zip(providers, forward, strict=True):
            call = _runtime_ids(ids, device)
            if call is not None:
                overlapped = overlap and (overlap_max_ids is None or call.numel() <= overlap_max_ids)
                for _ in provider.passes(call, overlap=overlapped):  # nothing reads the slots here
                    pass
    if scope == "layer":
        stats = [provider.stats for provider in providers]
    else:
        stats = [providers[0].pool.stats(provider.layer) for provider in providers]
    return tuple(sum(getattr(s, name) for s in stats) for name in ("hits", "misses", "evictions"))


def _configs():
    for name in FILES:
        for batch in (1, 8):
            yield pytest.param(name, batch, id=f"{name.split('__')[0]}-{Path(name).stem[:9]}-batch{batch}")


@pytest.mark.parametrize(("name", "batch"), list(_configs()))
@pytest.mark.filterwarnings("ignore::expertcache.sim.ApproximateReplayWarning")  # the runtime sees the same rows
def test_simulated_copies_equal_the_runtime_on_real_traces(name, batch):
    trace = _head(load_trace(TRACES / name), batch=batch)
    top_k = trace.expert_ids.shape[2]
    checked = 0
    for scope, slots, policy in (
        ("layer", top_k, "lru"),
        ("layer", max(top_k, trace.num_experts // 4), "arc"),
        ("global", top_k * trace.num_layers, "lru"),
    ):
        streams = trace_calls(trace, scope=scope)
        simulated = replay_streams(streams, policy=policy, capacity=slots)
        runtime = _run(trace, slots=slots, policy=policy, scope=scope, mode="host", device="cpu")
        assert runtime == (simulated.hits, simulated.misses, simulated.evictions), (scope, slots, policy)
        checked += simulated.split_calls
        if torch.cuda.is_available() and policy == "lru":
            device_mode = _run(trace, slots=slots, policy=policy, scope=scope, mode="device", device="cuda")
            assert device_mode == runtime, (scope, slots, "device")
        if simulated.split_calls:  # overlapped passes group oversize calls differently
            overlapped = replay_streams(streams, policy=policy, capacity=slots, oversize="overlapped")
            counts = (overlapped.hits, overlapped.misses, overlapped.evictions)
            host = _run(trace, slots=slots, policy=policy, scope=scope, mode="host", device="cpu", overlap=True)
            assert host == counts, (scope, slots, policy, "overlapped")
            middle = int(np.median([n for stream in streams for n in stream.num_ids]))  # as DecodeStack's limit
            limited = dict(policy=policy, capacity=slots, oversize="overlapped", overlap_max_ids=middle)
            mixed = replay_streams(streams, **limited)
            host = _run(trace, slots=slots, policy=policy, scope=scope, mode="host", device="cpu", overlap=True,
                        overlap_max_ids=middle)  # fmt: skip
            assert host == (mixed.hits, mixed.misses, mixed.evictions), (scope, slots, policy, "overlap_max_ids")
            if torch.cuda.is_available() and policy == "lru":
                on_gpu = _run(
                    trace, slots=slots, policy=policy, scope=scope, mode="device", device="cuda", overlap=True
                )
                assert on_gpu == counts, (scope, slots, "device, overlapped")
    if batch > 1:
        assert checked > 0  # batched calls exceed the smallest caches: the passes were exercised
