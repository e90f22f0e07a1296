"""Warming up and capturing `GraphedGenerator`'s decode step in a CUDA graph.

A bucket's first decode steps run eagerly on a side stream (`side_stream_step`: they
compile the kernels and settle lazy initialisation, on real tokens); then `capture` records
one step on the bucket's static buffers into a ``torch.cuda.CUDAGraph`` that every later
step replays. Recording runs nothing, and a step that synchronises with the host cannot be
recorded: the error `capture` raises then names the usual causes and the eager fallback.
Both run under the model's GPU as the current device (the generator's ``_step`` sets it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from expertcache.integrations.transformers.decode_buckets import Bucket

#: A bucket's decode step: ``[bucket, V]`` logits from its buffers (`StepCalls.forward`).
StepFunction = Callable[[Bucket], torch.Tensor]


def side_stream_step(forward: StepFunction, state: Bucket, device: torch.device) -> torch.Tensor:
    """One eager decode step on a side stream, joined to the current stream before it returns."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        logits = forward(state).clone()
    torch.cuda.current_stream(device).wait_stream(side)  # joined before anything else
    return logits


def capture(forward: StepFunction, state: Bucket) -> None:
    """Record one decode step (recording runs nothing: the replay that follows does)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            logits = forward(state)
    except RuntimeError as error:
        raise RuntimeError(
            f"capturing the decode step of batch bucket {state.size} failed: {error}. A step with a "
            f"host synchronisation cannot be captured: a host-mode expert cache, transformers' "
            f"'eager' experts implementation (it calls nonzero; use batched_mm or grouped_mm), a "
            f"data-dependent op in a custom router. GraphedGenerator(..., graphs=False) runs it eagerly."
        ) from error
    state.graph, state.logits = graph, logits
