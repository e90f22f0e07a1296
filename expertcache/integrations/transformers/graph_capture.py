"""Warming up and capturing `GraphedGenerator`'s decode step in a CUDA graph.

A bucket's first decode steps run eagerly on a side stream (`side_stream_step`: they
compile the kernels and settle lazy initialisation, on real tokens); then `capture` records
one step on the bucket's static buffers into a ``torch.cuda.CUDAGraph`` that every later
step replays. Recording runs nothing, and a step that synchronises with the host cannot be
recorded: the error `capture` raises then names the usual causes and the eager fallback.
Both run under the model's GPU as the current device (the generator's ``_step`` sets it).

A graph reads the model's weights and the expert cache's slots and tables by address.
`capture` notes them (`Addresses`); `drop_stale_graph` drops a graph that would read them
where they no longer are: ``handle.disable()`` frees the slots (the graph replayed the old
cache, reading and writing memory other tensors now hold), ``enable_expert_cache`` or
``model.to(dtype)`` moves weights. A graph that is no longer valid is dropped and the step
captured again.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from expertcache.integrations.transformers import dispatch
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


@dataclass(frozen=True)
class Addresses:
    """What a captured step reads outside its bucket's buffers.

    Attributes:
        tensors: ``(data_ptr, dtype)`` of every parameter and buffer of the model.
        bindings: per module, the `dispatch.Binding` serving it (its provider holds the
            slots, tables and policy state the graph reads), weakly; None where none does.
    """

    tensors: tuple[tuple[int, torch.dtype], ...]
    bindings: tuple[weakref.ref | None, ...]

    @classmethod
    def of(cls, model: nn.Module) -> Addresses:
        tensors = tuple((t.data_ptr(), t.dtype) for t in itertools.chain(model.parameters(), model.buffers()))
        bindings = (dispatch.binding_of(module) for module in model.modules())
        return cls(tensors, tuple(None if binding is None else weakref.ref(binding) for binding in bindings))

    def hold_for(self, model: nn.Module) -> bool:
        """Whether ``model``'s weights and expert caches are still these (same objects, same places)."""
        now = Addresses.of(model)
        if now.tensors != self.tensors or len(now.bindings) != len(self.bindings):
            return False
        return all(map(_same_binding, self.bindings, now.bindings))


def _same_binding(then: weakref.ref | None, now: weakref.ref | None) -> bool:
    if then is None or now is None:
        return then is now
    return then() is now()  # a binding gone since (a disabled cache) is None here


def drop_stale_graph(state: Bucket, model: nn.Module) -> None:
    """Drop ``state``'s graph when ``model``'s weights or caches moved since its capture (the
    next steps warm up and capture again)."""
    if state.graph is None or (state.addresses is not None and state.addresses.hold_for(model)):
        return
    state.graph, state.logits, state.addresses, state.warm_steps = None, None, None, 0


def capture(forward: StepFunction, state: Bucket, model: nn.Module) -> None:
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
    state.graph, state.logits, state.addresses = graph, logits, Addresses.of(model)
