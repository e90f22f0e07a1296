"""`GraphedGenerator`: decode a transformers causal LM one CUDA-graph replay per token.

The prompt is prefilled eagerly into a transformers ``StaticCache``; every later token is
one call of the same single-token step, whose tensors never move::

    per batch bucket b (1, 2, 4, ... up to max_batch_size; a batch is padded up to one):
      input_ids [b, 1] int64, position_ids [b, 1] int64, attention_mask [b, max_length] int64,
      StaticCache (keys/values [b, heads, max_length, head_dim] per layer, a device-side length)
      step = model(those buffers, cache) -> logits [b, V]   captured once, replayed per token

With ``enable_expert_cache(model, ..., mode="device")`` the expert cache is inside the step:
admission, copies and remap are captured with it, so misses are served in the graph
(`pass_runs`' capture branch). Host mode reads ids on the host every layer and cannot be
captured. Token choice (greedy, or temperature / top-p sampling with a seeded
``torch.Generator``) and the EOS bookkeeping run outside the graph on the copied logits.

Without graphs (the CPU; ``graphs=False``) the same buffers and the same step run eagerly:
the eager runner path, which the CPU tests compare token for token with ``model.generate``.

Lifetime and threading: one generator per model, used from one thread; its static caches
and graphs live as long as it does. Graphs capture the model's weights and the expert
cache's buffers by address: a request after they moved (``handle.disable()``,
``enable_expert_cache``, ``model.to(dtype)``) captures its bucket's step again instead of
replaying a graph that reads freed memory (`graph_capture.drop_stale_graph`). Drop the
generator before ``handle.disable()`` all the same: its graphs hold their memory until then.

This module holds the generator and `timed_generate`. A bucket's buffers and the model
calls on them are `decode_buckets`' (`bucket_sizes` is re-exported here), a request's
checks and EOS bookkeeping `decode_request`'s, the warm-up and the capture `graph_capture`'s,
and what the step needs around it (static cache, graphs or not, token choice) `decode_setup`'s.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from expertcache.integrations.transformers.decode_buckets import Bucket, StepCalls, bucket_sizes
from expertcache.integrations.transformers.decode_request import Stop, check_request
from expertcache.integrations.transformers.decode_setup import (
    check_model,
    choose_tokens,
    decode_experts_implementation,
    host_syncs,
    resolve_graphs,
    static_cache,
)
from expertcache.integrations.transformers.generation import GenerationRun
from expertcache.integrations.transformers.graph_capture import capture, drop_stale_graph, side_stream_step
from expertcache.validation import check_int

__all__ = ["GraphedGenerator", "bucket_sizes", "timed_generate"]

#: Eager decode steps before a bucket's step is captured, unless the caller says otherwise.
DEFAULT_WARMUP_STEPS = 2


class GraphedGenerator:
    """Greedy or sampled generation with the decode step captured in CUDA graphs.

    Args:
        model: a transformers ``*ForCausalLM`` (5.x), with or without the expert cache.
        max_length: prompt plus new tokens, at most (the static caches' length).
        max_batch_size: the largest batch `generate` takes.
        graphs: ``True``, ``False`` or ``"auto"`` (graphs when the model is on CUDA and
            nothing in the step reads the device from the host: `host_syncs`).
        warmup_steps: eager decode steps (on a side stream, real tokens) before a bucket's
            step is captured: they compile the kernels and settle lazy initialisation. Only
            with graphs: refused with ``graphs=False``, a warning where "auto" runs eagerly.

    Raises:
        ValueError: graphs requested off CUDA, or with a host-mode expert cache or a routing
            recorder; with graphs, a sliding window shorter than ``max_length``; a size < 1;
            ``max_length`` above the model's ``max_position_embeddings``; ``warmup_steps``
            other than the default with ``graphs=False`` (nothing is captured: it would be ignored).
        TypeError: a size that is not an integer (numpy's are; a bool or a float is not);
            ``graphs`` not a bool or ``"auto"``; ``model`` not a transformers model (an
            `ExpertCacheHandle`, say).

    Warns:
        UserWarning: once, here, when ``graphs="auto"`` runs the step eagerly (the model off
            CUDA; a host read in the step, `host_syncs`) and ``warmup_steps`` is not the
            default: nothing is captured, so the warm-up has no effect. "auto" is kept
            portable (the same call runs on a CPU); drop ``warmup_steps`` to silence it.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_length: int,
        max_batch_size: int = 1,
        graphs: bool | str = "auto",
        warmup_steps: int = DEFAULT_WARMUP_STEPS,
    ) -> None:
        max_length = check_int("max_length", max_length, minimum=1)
        max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1)
        check_int("warmup_steps", warmup_steps, minimum=1)  # capture follows eager steps
        self.device = check_model(model, max_length)
        self.model = model
        self.max_length = max_length
        self.buckets = bucket_sizes(max_batch_size)
        self.graphs = resolve_graphs(model, graphs, self.device)
        if graphs is False and warmup_steps != DEFAULT_WARMUP_STEPS:
            raise ValueError(
                f"warmup_steps={warmup_steps} given with graphs=False, which captures nothing and would ignore it: "
                f"drop warmup_steps, or pass graphs=True or 'auto'"
            )
        if self.graphs:
            static_cache(model, max_length)  # refuses a sliding window now (tensors come lazily)
        self.warmup_steps = warmup_steps
        self._calls = StepCalls.of(model, max_length, self.device)
        self._states: dict[int, Bucket] = {}
        self.replays = 0
        if not self.graphs and warmup_steps != DEFAULT_WARMUP_STEPS:  # "auto" chose the eager path
            warnings.warn(_eager_warmup_message(model, warmup_steps, self.device), stacklevel=2)

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        """Bucket sizes whose decode step is captured in a graph."""
        return tuple(size for size, state in sorted(self._states.items()) if state.graph is not None)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """Generate up to ``max_new_tokens`` tokens per sequence (like ``model.generate``).

        Args:
            input_ids: ``[B, P]`` int64 prompts on the model's device (left-padded when
                their lengths differ).
            max_new_tokens: tokens to generate per sequence, ``P + max_new_tokens <= max_length``.
            attention_mask: ``[B, P]`` integers or bools, 1 for tokens, 0 for left padding
                (default all ones); every row ends with a token.
            do_sample: ``True``: sample (``temperature`` in (0, inf), ``top_p`` in (0, 1],
                ``generator``) instead of taking the argmax. With ``False`` those three must
                stay at their defaults (1.0, 1.0, None): a setting given is never ignored.
            generator: the sampling generator (on the model's device), for reproducible samples.
            eos_token_id: a token id or a non-empty list of them, in the vocabulary: a sequence
                stops after one of these; finished ones get ``pad_token_id`` (default: the
                first EOS id) and generation ends when all have stopped.
            pad_token_id: a token id in the vocabulary, only with ``eos_token_id`` (alone it
                would be ignored: refused).

        Returns:
            ``[B, P + N]`` int64: the prompts and ``N <= max_new_tokens`` new tokens.

        Raises:
            TypeError / ValueError: naming the argument, before any work (the cache and this
            generator are left as they were).
        """
        request = check_request(
            self, input_ids, max_new_tokens, attention_mask,
            do_sample=do_sample, temperature=temperature, top_p=top_p, generator=generator,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )  # fmt: skip
        max_new_tokens = request.max_new_tokens
        state = self._bucket(request.batch)
        drop_stale_graph(state, self.model)  # a cache disabled or enabled since: captured again
        logits = self._calls.prefill(state, input_ids, request.mask)
        choose = functools.partial(
            choose_tokens, do_sample=request.do_sample, temperature=temperature, top_p=top_p, generator=generator
        )
        stop = Stop.of(request, state.size, self.device)
        new = torch.empty(state.size, max_new_tokens, dtype=torch.long, device=self.device)
        produced = max_new_tokens
        with decode_experts_implementation(self.model, self.device):
            for step in range(max_new_tokens):
                tokens = stop.update(choose(logits))
                new[:, step] = tokens
                if step == max_new_tokens - 1 or stop.all_finished():
                    produced = step + 1
                    break
                state.input_ids.copy_(tokens.unsqueeze(1))
                state.position_ids.add_(1)
                logits = self._step(state)
        return torch.cat([input_ids, new[: request.batch, :produced]], dim=1)

    def eager_step(self, batch: int) -> torch.Tensor:
        """Run, eagerly, the decode step a graph captures, on the buffers of ``batch``'s bucket
        as the last `generate` left them (it advances that bucket's cache by one token).

        For checking the step itself: under ``FakeTensorMode`` a data-dependent op (one a
        capture cannot record) raises. Returns ``[bucket, V]`` logits.
        """
        size = self.bucket_for(batch)
        if size not in self._states:
            raise ValueError(f"bucket {size} has not run yet: generate() with a batch of {batch} first")
        return self._calls.forward(self._states[size])

    def bucket_for(self, batch: int) -> int:
        """The bucket (padded batch size) a batch of ``batch`` sequences runs in.

        Raises:
            TypeError: ``batch`` is not an integer. ValueError: below 1 or above ``max_batch_size``.
        """
        batch = check_int("batch", batch, minimum=1)
        for size in self.buckets:
            if size >= batch:
                return size
        raise ValueError(f"batch {batch} exceeds max_batch_size {self.buckets[-1]}")

    def _bucket(self, batch: int) -> Bucket:
        size = self.bucket_for(batch)
        if size not in self._states:
            self._states[size] = Bucket(
                size,
                static_cache(self.model, self.max_length, keep_sliding=not self.graphs),
                torch.zeros(size, 1, dtype=torch.long, device=self.device),
                torch.zeros(size, 1, dtype=torch.long, device=self.device),
                torch.ones(size, self.max_length, dtype=torch.long, device=self.device),
            )
        return self._states[size]

    def _step(self, state: Bucket) -> torch.Tensor:
        """One decode step on the bucket's buffers: ``[bucket, V]`` logits (a fresh tensor)."""
        if not self.graphs:
            return self._calls.forward(state)
        with torch.cuda.device(self.device):  # streams and captures belong to the model's GPU
            if state.graph is None and state.warm_steps < self.warmup_steps:
                state.warm_steps += 1
                return side_stream_step(self._calls.forward, state, self.device)
            if state.graph is None:
                capture(self._calls.forward, state, self.model)
            assert state.graph is not None and state.logits is not None
            state.graph.replay()
            self.replays += 1
            return state.logits.clone()


def _eager_warmup_message(model: Any, warmup_steps: int, device: torch.device) -> str:
    """Why ``warmup_steps`` has no effect: what made ``graphs="auto"`` choose the eager path."""
    reasons = ([] if device.type == "cuda" else [f"the model is on {device}, not a CUDA device"]) + host_syncs(model)
    return (
        f"warmup_steps={warmup_steps} has no effect: graphs='auto' runs the decode step eagerly here "
        f"({'; '.join(reasons)}), so nothing is warmed up or captured. Drop warmup_steps (or pass "
        f"graphs=True to require capture)"
    )


def timed_generate(runner: GraphedGenerator, input_ids: torch.Tensor, max_new_tokens: int, **options) -> GenerationRun:
    """`GraphedGenerator.generate` timed like `generation.greedy_generate` (device synchronised
    before and after; peak device memory on CUDA)."""
    device = runner.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    tokens = runner.generate(input_ids, max_new_tokens=max_new_tokens, **options)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return GenerationRun(tokens.cpu(), tokens.shape[1] - input_ids.shape[1], seconds, peak)
