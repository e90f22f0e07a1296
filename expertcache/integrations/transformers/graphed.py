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
cache's buffers by address: build the generator after ``enable_expert_cache`` and drop it
before ``handle.disable()`` (a graph replayed after that would read freed memory).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from expertcache.integrations.transformers.decode_setup import (
    choose_tokens,
    decode_experts_implementation,
    resolve_graphs,
    static_cache,
)
from expertcache.integrations.transformers.generation import GenerationRun


def bucket_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The batch buckets: powers of two below ``max_batch_size``, then ``max_batch_size``."""
    sizes = [1 << n for n in range(max_batch_size.bit_length()) if 1 << n < max_batch_size]
    return (*sizes, max_batch_size)


@dataclass(slots=True)
class _Bucket:
    """Static buffers of one batch bucket (addresses fixed for the generator's lifetime)."""

    size: int
    cache: Any  # transformers StaticCache
    input_ids: torch.Tensor  # [size, 1] int64
    position_ids: torch.Tensor  # [size, 1] int64
    attention_mask: torch.Tensor  # [size, max_length] int64
    warm_steps: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [size, V], the graph's output


@dataclass(slots=True)
class _Stop:
    """EOS bookkeeping as ``generate`` does it: a finished sequence emits ``pad`` from then on."""

    eos: torch.Tensor | None  # [n] int64 EOS ids, or None: never stop early
    pad: int
    finished: torch.Tensor  # [bucket] bool
    batch: int  # the real rows (the rest pad the bucket)

    @classmethod
    def of(cls, eos_token_id, pad_token_id, size: int, batch: int, device: torch.device) -> _Stop:
        eos = None if eos_token_id is None else torch.tensor(eos_token_id, device=device).view(-1)
        pad = int(eos[0]) if eos is not None and pad_token_id is None else (pad_token_id or 0)
        return cls(eos, pad, torch.zeros(size, dtype=torch.bool, device=device), batch)

    def update(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.eos is None:
            return tokens
        tokens = torch.where(self.finished, self.pad, tokens)
        self.finished |= torch.isin(tokens, self.eos)
        return tokens

    def all_finished(self) -> bool:
        # a host read per step, as generate() makes one; none without EOS ids
        return self.eos is not None and bool(self.finished[: self.batch].all())


class GraphedGenerator:
    """Greedy or sampled generation with the decode step captured in CUDA graphs.

    Args:
        model: a transformers ``*ForCausalLM`` (5.x), with or without the expert cache.
        max_length: prompt plus new tokens, at most (the static caches' length).
        max_batch_size: the largest batch `generate` takes.
        graphs: ``True``, ``False`` or ``"auto"`` (graphs when the model is on CUDA and
            nothing in the step reads the device from the host: `host_syncs`).
        warmup_steps: eager decode steps (on a side stream, real tokens) before a bucket's
            step is captured: they compile the kernels and settle lazy initialisation.

    Raises:
        ValueError: graphs requested off CUDA, or with a host-mode expert cache or a routing
            recorder; with graphs, a sliding window shorter than ``max_length``; a size < 1.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_length: int,
        max_batch_size: int = 1,
        graphs: bool | str = "auto",
        warmup_steps: int = 2,
    ) -> None:
        for name, value in (("max_length", max_length), ("max_batch_size", max_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1 (capture follows eager steps), got {warmup_steps!r}")
        self.model = model
        self.max_length = max_length
        self.buckets = bucket_sizes(max_batch_size)
        self.device = model.get_input_embeddings().weight.device
        self.graphs = resolve_graphs(model, graphs, self.device)
        if self.graphs:
            static_cache(model, max_length)  # refuses a sliding window now (tensors come lazily)
        self.warmup_steps = warmup_steps
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # transformers' eager attention builds its additive mask with a host scalar copied to
        # the GPU (5.17), which a capture refuses: the step hands it the finished 4D mask
        self._additive_mask = getattr(model.config, "_attn_implementation", None) == "eager"
        self._mask_dtype = model.get_input_embeddings().weight.dtype
        self._states: dict[int, _Bucket] = {}
        self.replays = 0

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
            attention_mask: ``[B, P]`` 1 for tokens, 0 for left padding (default all ones).
            do_sample: sample (``temperature``, ``top_p``) instead of taking the argmax.
            generator: the sampling generator (on the model's device), for reproducible samples.
            eos_token_id: a sequence stops after one of these; finished ones get ``pad_token_id``
                (default: the first EOS id) and generation ends when all have stopped.

        Returns:
            ``[B, P + N]`` int64: the prompts and ``N <= max_new_tokens`` new tokens.
        """
        batch = self._check_request(input_ids, max_new_tokens, attention_mask, temperature, top_p)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.long)
        state = self._bucket(batch)
        logits = self._prefill(state, input_ids, mask)
        choose = functools.partial(
            choose_tokens, do_sample=do_sample, temperature=temperature, top_p=top_p, generator=generator
        )
        stop = _Stop.of(eos_token_id, pad_token_id, state.size, batch, self.device)
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
        return torch.cat([input_ids, new[:batch, :produced]], dim=1)

    def eager_step(self, batch: int) -> torch.Tensor:
        """Run, eagerly, the decode step a graph captures, on the buffers of ``batch``'s bucket
        as the last `generate` left them (it advances that bucket's cache by one token).

        For checking the step itself: under ``FakeTensorMode`` a data-dependent op (one a
        capture cannot record) raises. Returns ``[bucket, V]`` logits.
        """
        size = self.bucket_for(batch)
        if size not in self._states:
            raise ValueError(f"bucket {size} has not run yet: generate() with a batch of {batch} first")
        return self._forward(self._states[size])

    def bucket_for(self, batch: int) -> int:
        """The bucket (padded batch size) a batch of ``batch`` sequences runs in."""
        for size in self.buckets:
            if size >= batch:
                return size
        raise ValueError(f"batch {batch} exceeds max_batch_size {self.buckets[-1]}")

    def _check_request(self, input_ids, max_new_tokens, attention_mask, temperature, top_p) -> int:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError("input_ids must be a [batch, prompt] int64 tensor")
        batch, prompt = input_ids.shape
        if input_ids.device != self.device:
            raise ValueError(f"input_ids are on {input_ids.device}, the model on {self.device}")
        if not 1 <= batch <= self.buckets[-1] or prompt < 1:
            raise ValueError(f"batch must be in [1, {self.buckets[-1]}] with a prompt, got {tuple(input_ids.shape)}")
        vocab = self.model.get_input_embeddings().num_embeddings
        low, high = int(input_ids.min()), int(input_ids.max())  # one sync per request, before any work
        if low < 0 or high >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}) (the model's vocabulary), got {low}..{high}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if prompt + max_new_tokens > self.max_length:
            raise ValueError(
                f"prompt ({prompt}) + max_new_tokens ({max_new_tokens}) exceeds max_length {self.max_length}"
            )
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must be shaped like input_ids {tuple(input_ids.shape)}")
        if not temperature > 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature > 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        return batch

    def _bucket(self, batch: int) -> _Bucket:
        size = self.bucket_for(batch)
        if size not in self._states:
            self._states[size] = _Bucket(
                size,
                static_cache(self.model, self.max_length, keep_sliding=not self.graphs),
                torch.zeros(size, 1, dtype=torch.long, device=self.device),
                torch.zeros(size, 1, dtype=torch.long, device=self.device),
                torch.ones(size, self.max_length, dtype=torch.long, device=self.device),
            )
        return self._states[size]

    def _prefill(self, state: _Bucket, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run the prompts (padded to the bucket with copies of row 0) into the cache.

        Returns ``[bucket, V]`` logits of each row's last token; leaves the step's buffers
        ready for the first decode step (positions of the last prompt token, the mask).
        """
        filler = state.size - input_ids.shape[0]
        if filler:
            input_ids = torch.cat([input_ids, input_ids[:1].expand(filler, -1)])
            mask = torch.cat([mask, mask[:1].expand(filler, -1)])
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() numbers them
        state.cache.reset()  # in place: the graph's addresses stay valid
        kwargs = {self._cache_kwarg: state.cache}
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1, **kwargs
        )
        state.attention_mask.fill_(1)
        state.attention_mask[:, : mask.shape[1]].copy_(mask)
        state.position_ids.copy_(positions[:, -1:])
        return out.logits[:, -1]

    def _step_mask(self, state: _Bucket) -> torch.Tensor:
        """The decode step's attention mask: the ``[b, max_length]`` padding mask, or for eager
        attention the ``[b, 1, 1, max_length]`` additive mask transformers would build from it
        (0 where a row may attend: not padding and at most the cache's length; else the
        dtype's minimum), from device tensors only, so the graph recomputes it each replay."""
        length = state.cache.get_seq_length()
        if not self._additive_mask or not isinstance(length, torch.Tensor):
            return state.attention_mask
        positions = torch.arange(self.max_length, device=self.device)
        keep = state.attention_mask.bool() & (positions <= length.to(self.device))
        blocked = torch.full_like(keep, torch.finfo(self._mask_dtype).min, dtype=self._mask_dtype)
        return torch.where(keep, torch.zeros_like(blocked), blocked)[:, None, None, :]

    def _forward(self, state: _Bucket) -> torch.Tensor:
        kwargs = {self._cache_kwarg: state.cache}
        out = self.model(
            input_ids=state.input_ids,
            attention_mask=self._step_mask(state),
            position_ids=state.position_ids,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1]

    def _step(self, state: _Bucket) -> torch.Tensor:
        """One decode step on the bucket's buffers: ``[bucket, V]`` logits (a fresh tensor)."""
        if not self.graphs:
            return self._forward(state)
        with torch.cuda.device(self.device):  # streams and captures belong to the model's GPU
            if state.graph is None and state.warm_steps < self.warmup_steps:
                state.warm_steps += 1
                return self._side_stream_step(state)
            if state.graph is None:
                self._capture(state)
            assert state.graph is not None and state.logits is not None
            state.graph.replay()
            self.replays += 1
            return state.logits.clone()

    def _side_stream_step(self, state: _Bucket) -> torch.Tensor:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            logits = self._forward(state).clone()
        torch.cuda.current_stream(self.device).wait_stream(side)  # joined before anything else
        return logits

    def _capture(self, state: _Bucket) -> None:
        """Record one decode step (recording runs nothing: the replay that follows does)."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                logits = self._forward(state)
        except RuntimeError as error:
            raise RuntimeError(
                f"capturing the decode step of batch bucket {state.size} failed: {error}. A step with a "
                f"host synchronisation cannot be captured: a host-mode expert cache, transformers' "
                f"'eager' experts implementation (it calls nonzero; use batched_mm or grouped_mm), a "
                f"data-dependent op in a custom router. GraphedGenerator(..., graphs=False) runs it eagerly."
            ) from error
        state.graph, state.logits = graph, logits


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
