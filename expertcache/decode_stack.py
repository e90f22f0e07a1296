"""`DecodeStack`: a multi-layer MoE decode step, made to be captured in one CUDA graph.

The shape of what an engine runs per generated token, with the cache inside::

    for each layer:  h = rms_norm(h + h @ attention)               (stand-in GEMM)
                     logits = h @ router;  weights = softmax(logits at the given ids)
                     results = provider.passes(ids, overlap=True)   (cache: admit, copy, remap)
                     h = h + apply(h, results, weights)             (moe_apply over the passes)

A call needing more experts than the slots runs as several passes (`expertcache.passes`),
overlapped (``overlap``): groups of half the slots, each pass's copies on a side stream while
the pass before computes. Decode batches that fit take one pass. In device mode, on a pool
that cannot hold the whole layer, the first pass comes as two: its hits, computed while its
misses are copied on a side stream, then its misses. The apply sums passes exactly, so the
output is the same bits.

``step(h, routing, prefetch)`` also hands each layer's predicted experts to the cache
``lookahead`` layers on as soon as this layer's router has run (``providers[l + d].prefetch``,
device mode; the first router also hands layers 1 .. d their rows): their copies overlap the
work of the layers between. With ``across_steps`` the hand-offs wrap: the last ``d`` routers
hand the next step's first ``d`` layers their rows, so copies for the next token start
before this one ends. Any predictor fits; the benchmarks use the trace itself (an oracle)
to measure what a good one could win.

Routing ids are an input (replayed from a trace, or any router's top-k), so a captured
graph replays with fresh routing every step. With device-mode providers the captured step
contains admissions and copies: misses are served inside the graph.

This module owns the stack: its layers, settings and step. What a stack checks before any
layer runs is in `expertcache.decode_stack_checks`; the step captured once in a CUDA graph,
`GraphedDecodeStep`, in `expertcache.graphed_decode_step` (importable from here too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from expertcache.decode_stack_checks import check_prefetch, check_router_width, check_step
from expertcache.graphed_decode_step import GraphedDecodeStep
from expertcache.kernels.apply_passes import moe_apply_passes
from expertcache.kernels.quant_passes import moe_apply_quant_passes
from expertcache.passes import OVERLAP_MAX_IDS
from expertcache.provider import ExpertWeightProvider
from expertcache.result import ExpertWeightResult
from expertcache.validation import check_flag, check_int, check_overlap

if TYPE_CHECKING:
    from expertcache.cached_provider import CachedWeightProvider

__all__ = ["DecodeStack", "ExpertApply", "GraphedDecodeStep"]


#: An expert apply over the passes of one call: ``(hidden [T, H], results, topk_weights
#: [T, K]) -> [T, H]`` in ``hidden``'s dtype (`expertcache.kernels.moe_apply_passes`).
ExpertApply = Callable[[torch.Tensor, Iterable[ExpertWeightResult], torch.Tensor], torch.Tensor]


class DecodeStack:
    """``L`` MoE layers fed by ``providers`` (one per layer), random dense parts.

    Args:
        providers: one weight provider per layer (full, host- or device-mode cached).
        hidden_size: ``H``, an integer of at least 1.
        num_experts: ``E`` (router width), an integer of at least 1: the experts of each
            layer (a provider's ``num_global_experts``, where it says).
        dtype, device: of the dense parts and activations.
        seed: an integer; the dense parts are drawn from it, so stacks with the same seed
            compute the same function.
        apply: the expert kernel over a call's passes (default `moe_apply_passes`).
        overlap: let the caches overlap copies with compute (``provider.passes(ids,
            overlap=True)``: overlapped passes, and a decode call's hits computed while its
            misses are copied), for calls of at most `OVERLAP_MAX_IDS` ids: only for an
            ``apply`` that sums passes exactly. Default (None): on for `moe_apply_passes`
            and `moe_apply_quant_passes`, off for any other ``apply``.
        landing: with ``overlap``, let a device-mode cache hand over its copied passes with
            landing counters (``provider.passes(ids, overlap=True, landing=True)``), so the
            apply starts on each expert as it lands: only for an ``apply`` that waits on
            them (`expertcache.kernels.landing`). Default (None): on for `moe_apply_passes`
            (and a ``functools.partial`` of it) when ``overlap`` is, off otherwise.
        lookahead: ``d``, an integer of at least 1: how many layers on a router hands its
            step's predictions (``step``'s ``prefetch``): layer ``l``'s router starts layer
            ``l + d``'s prefetch, so ``d`` layers' copies may share the link at once. Default
            2: on the H200, with oracle guesses all right 1.0-2.9% faster than 1 at batches
            1-8 (0.1-1.7% with 6 of 8 right), and 3 no faster than 2 (`benchmarks/README.md`,
            run 105).
        across_steps: let the hand-offs wrap into the next step: layer ``l``'s router starts
            layer ``(l + d) mod L``'s prefetch, which for ``l + d >= L`` is that layer's call
            in the next step (``step``'s ``prefetch`` rows ``0 .. d-1`` then hold the next
            step's predictions). Needs ``d < L``. A captured step joins those copies before
            it ends (`CachedWeightProvider.finish_prefetch`: a graph must join its side
            streams); an eager step leaves them running into the next. Default False.
    """

    def __init__(
        self,
        providers: Sequence[ExpertWeightProvider],
        hidden_size: int,
        num_experts: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        seed: int = 0,
        apply: ExpertApply = moe_apply_passes,
        overlap: bool | None = None,
        landing: bool | None = None,
        lookahead: int = 2,
        across_steps: bool = False,
    ) -> None:
        providers = list(providers)
        hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        num_experts = check_int("num_experts", num_experts, minimum=1)
        seed = check_int("seed", seed)
        self.lookahead = check_int("lookahead", lookahead, minimum=1)
        self.across_steps = check_flag("across_steps", across_steps)
        if self.across_steps and self.lookahead >= len(providers):
            raise ValueError(
                f"across_steps needs lookahead < the number of layers ({len(providers)}), got {self.lookahead}: "
                "a router would hand its own layer the next step's experts before this step's call"
            )
        if not callable(apply):
            raise TypeError(f"apply must be an expert apply over passes (e.g. moe_apply_passes), got {apply!r:.40}")
        check_router_width(providers, num_experts)
        self.apply = apply
        if overlap is None:
            overlap = apply in (moe_apply_passes, moe_apply_quant_passes)
        self.overlap = check_overlap(overlap)
        self._landing = None if landing is None else check_flag("landing", landing)
        if self._landing and not self.overlap:
            raise ValueError("landing needs overlap: only overlapped passes hand over copies still arriving")
        if self._landing and getattr(apply, "func", apply) is moe_apply_quant_passes:
            raise ValueError(
                "landing=True needs an apply that waits on landing counters (moe_apply_passes); "
                "moe_apply_quant_passes does not"
            )
        gen = torch.Generator().manual_seed(seed)
        scale = hidden_size**-0.5
        self.providers = providers
        self.attention = [
            (torch.randn(hidden_size, hidden_size, generator=gen) * scale).to(device, dtype) for _ in self.providers
        ]
        self.router = [
            (torch.randn(hidden_size, num_experts, generator=gen) * scale).to(device, dtype) for _ in self.providers
        ]

    @property
    def landing(self) -> bool:
        """Whether the caches are asked for landing counters: as given, or (None) whether the
        stack overlaps and its ``apply`` (now: it may be swapped) is `moe_apply_passes`."""
        if self._landing is not None:
            return self._landing
        return self.overlap and getattr(self.apply, "func", self.apply) is moe_apply_passes

    @property
    def num_layers(self) -> int:
        return len(self.providers)

    def step(self, hidden: torch.Tensor, routing: torch.Tensor, prefetch: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step.

        Args:
            hidden: ``[T, H]`` activations.
            routing: ``[L, T, K]`` int expert ids per layer.
            prefetch: optional ``[L, T, P]`` predicted ids per layer: row ``l + d`` goes to
                ``providers[l + d].prefetch`` once layer ``l``'s router has run, rows 1 .. d
                once layer 0's has (``d`` the stack's ``lookahead``; row 0 is unused: nothing
                runs before the first layer); ``T * P`` at most each cache's slots, and layers
                1 .. L-1 device-mode caches (checked before any layer runs). With
                ``across_steps``: row ``(l + d) mod L`` goes at layer ``l``'s router, rows
                ``0 .. d-1`` are the next step's predictions, and every layer's cache must
                be in device mode.

        Returns:
            ``[T, H]`` activations after the last layer.

        Raises:
            TypeError / ValueError: bad shapes, dtypes or devices of any input, routing ids
                outside ``[0, E)`` (read in eager steps only: a captured step cannot sync),
                predictions a cache would refuse. Raised before any layer runs.
            An error inside a layer (its ``apply``) ends that layer's call (its passes
            closed) before it propagates: the next step runs, and prefetches, as usual.
        """
        check_step(self, hidden, routing)
        if prefetch is not None:
            check_prefetch(self, prefetch, routing)
        h = hidden
        wrapped: list[int] = []  # layers whose prefetch is for the next step's call
        for layer, provider in enumerate(self.providers):
            h = F.rms_norm(h + h @ self.attention[layer], (h.shape[-1],))
            ids = routing[layer]
            logits = (h @ self.router[layer]).float()
            weights = torch.softmax(logits.gather(1, ids.long()), dim=-1)
            if prefetch is not None:  # device-mode caches (checked above)
                for ahead in self._prefetched_at(layer):
                    cast("CachedWeightProvider", self.providers[ahead]).prefetch(prefetch[ahead])
                    if ahead <= layer:
                        wrapped.append(ahead)
            h = h + self._experts(provider, h, ids, weights)
        if wrapped and hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            for index in wrapped:  # the graph must join them; the next step's calls are outside it
                cast("CachedWeightProvider", self.providers[index]).finish_prefetch()
        return h

    def _experts(
        self, provider: ExpertWeightProvider, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """One layer's expert output: its call's passes through ``apply``. The call ends with
        the apply, even one that raised between two passes: an open overlapped call keeps its
        misses' slots promised, refusing the layer's prefetches until its generator is collected
        (the exception's traceback holds it, maybe for good)."""
        overlap = self.overlap and ids.numel() <= OVERLAP_MAX_IDS
        if not overlap:
            results = provider.passes(ids)
        elif self.landing:  # asked only then: a provider written before landing takes overlap alone
            results = provider.passes(ids, overlap=True, landing=True)
        else:
            results = provider.passes(ids, overlap=True)
        try:
            return self.apply(hidden, results, weights)
        finally:
            close = getattr(results, "close", None)
            if close is not None:  # a finished call's generator: a no-op
                close()

    def _prefetched_at(self, layer: int) -> range:
        """The layers whose predictions layer ``layer``'s router hands on: ``layer + d``, and
        at the first router every layer up to ``d`` (``d`` the ``lookahead``); across steps,
        ``(layer + d) mod L`` alone."""
        ahead = layer + self.lookahead
        if self.across_steps:
            return range(ahead % self.num_layers, ahead % self.num_layers + 1)
        return range(1 if layer == 0 else ahead, min(ahead, self.num_layers - 1) + 1)
