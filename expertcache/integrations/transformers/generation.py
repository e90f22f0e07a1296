"""Timed greedy generation with a progress bar, shared by the demo, the CLI and the benchmarks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class GenerationRun:
    """One ``model.generate`` call.

    Attributes:
        tokens: ``[B, P + N]`` int64, the prompt followed by the new tokens.
        new_tokens: ``N`` per sequence.
        seconds: wall time of the call (the device synchronised before and after).
        peak_bytes: ``torch.cuda.max_memory_allocated`` during the call, or None off CUDA.
    """

    tokens: torch.Tensor
    new_tokens: int
    seconds: float
    peak_bytes: int | None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens.shape[0] * self.new_tokens / self.seconds if self.seconds else 0.0


class _TokenProgress:
    """A generate() streamer that advances a tqdm bar by one per decoded token."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:  # the first call carries the prompt
            self.bar.update(1)
        self._prompt_seen = True

    def end(self) -> None:
        self.bar.close()


def greedy_generate(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    progress: str | None = None,
    stop_at_eos: bool = False,
) -> GenerationRun:
    """Greedy decoding of ``max_new_tokens`` tokens per sequence.

    Args:
        model: a transformers ``*ForCausalLM``.
        input_ids: ``[B, P]`` int64 prompt on the model's device.
        max_new_tokens: tokens to generate per sequence.
        progress: a tqdm description to show a bar with (batch size 1 only, on a
            terminal: none in a log), or None.
        stop_at_eos: stop at the model's end-of-sequence token (default: always generate
            exactly ``max_new_tokens``, so runs compare token for token).
    """
    device = input_ids.device
    streamer = None
    if progress is not None and input_ids.shape[0] == 1:
        # disable=None: shown on a terminal, silent when stderr is a file or a pipe (logs)
        bar = tqdm(total=max_new_tokens, desc=progress, unit="tok", leave=False, disable=None)
        streamer = _TokenProgress(bar)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=None if stop_at_eos else max_new_tokens,
            do_sample=False,
            pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0,
            streamer=streamer,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return GenerationRun(tokens.cpu(), tokens.shape[1] - input_ids.shape[1], seconds, peak)
