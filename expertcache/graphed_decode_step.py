"""`GraphedDecodeStep`: a `DecodeStack`'s step captured once in a CUDA graph, replayed with
fresh inputs. It owns the warm-up before capture, the captured input and output buffers,
the checks that a replay's inputs fit them, and the joins of prefetch copies a graph must
not leave running."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from expertcache.decode_stack import DecodeStack


class GraphedDecodeStep:
    """``stack.step`` captured once in a ``torch.cuda.CUDAGraph``; replay with new inputs.

    Construction runs ``warmup_routing.shape[0]`` eager steps (compiling the kernels) on a
    side stream, joins it, then captures one step. The warm-up steps are real steps: with
    a cache they admit experts like any other.

    Args:
        stack: the decode stack.
        hidden: ``[T, H]`` example activations (shape and dtype of every later input).
        warmup_routing: ``[W, L, T, K]`` routing of the warm-up steps (``W >= 1``).
        warmup_prefetch: optional ``[W, L, T, P]`` predictions of the warm-up steps: the
            graph then prefetches (``stack.step``'s ``prefetch``), and every replay takes them.
    """

    def __init__(
        self,
        stack: DecodeStack,
        hidden: torch.Tensor,
        warmup_routing: torch.Tensor,
        warmup_prefetch: torch.Tensor | None = None,
    ) -> None:
        self.stack = stack
        self.hidden = hidden.clone()
        self.routing = warmup_routing[0].clone()
        self.prefetch = None if warmup_prefetch is None else warmup_prefetch[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for index, routing in enumerate(warmup_routing):
                self.routing.copy_(routing)
                if self.prefetch is not None and warmup_prefetch is not None:
                    self.prefetch.copy_(warmup_prefetch[index])
                stack.step(self.hidden, self.routing, self.prefetch)
            self._finish_prefetches()  # across steps the last warm-up step left prefetches running
        torch.cuda.current_stream().wait_stream(side)  # joined before capture begins
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = stack.step(self.hidden, self.routing, self.prefetch)

    def __call__(
        self, hidden: torch.Tensor, routing: torch.Tensor, prefetch: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Replay one step on ``hidden`` ``[T, H]`` with ``routing`` ``[L, T, K]`` (and
        ``prefetch`` ``[L, T, P]`` exactly when the graph was captured with predictions).

        Returns the graph's output buffer (overwritten by the next replay).

        Raises:
            ValueError / TypeError: ``prefetch`` given against how the graph was captured, an
                input of another shape or dtype than the captured one (copying it in would
                truncate float ids or round activations).
        """
        if (prefetch is None) != (self.prefetch is None):
            raise ValueError("pass prefetch exactly when the graph was captured with warmup_prefetch")
        for name, given, captured in (("hidden", hidden, self.hidden), ("routing", routing, self.routing),
                                      ("prefetch", prefetch, self.prefetch)):  # fmt: skip
            if given is not None and captured is not None and given.shape != captured.shape:
                raise ValueError(
                    f"{name} has shape {tuple(given.shape)}; the graph was captured with {tuple(captured.shape)}"
                )
            if given is not None and captured is not None and given.dtype != captured.dtype:
                raise TypeError(f"{name} is {given.dtype}; the graph was captured with {captured.dtype}")
        if self.stack.across_steps:  # an eager step before this replay may have left prefetches running
            self._finish_prefetches()
        self.hidden.copy_(hidden)
        self.routing.copy_(routing)
        if self.prefetch is not None and prefetch is not None:  # both or neither (checked above)
            self.prefetch.copy_(prefetch)
        self.graph.replay()
        return self.output

    def _finish_prefetches(self) -> None:
        """Make the current stream wait for prefetch copies the caches still run (a no-op where
        none does): a graph's calls wait only for the prefetches captured with them."""
        for provider in self.stack.providers:
            finish = getattr(provider, "finish_prefetch", None)
            if finish is not None:
                finish()
