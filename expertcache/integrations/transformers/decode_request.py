"""One `GraphedGenerator.generate` request: its checks, and its EOS bookkeeping.

`check_request` refuses, before any work, a request the generator cannot run as
``model.generate`` would (shapes, device, token ids outside the vocabulary, lengths past
the static caches, sampling settings out of range); `Stop` then follows, step by step,
which sequences have emitted an EOS id, as ``generate`` does: a finished one emits ``pad``
from then on, and decoding ends when every real row (not the bucket's padding) has finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from expertcache.validation import check_int

if TYPE_CHECKING:
    from expertcache.integrations.transformers.graphed import GraphedGenerator


def check_request(runner: GraphedGenerator, input_ids, max_new_tokens, attention_mask, temperature, top_p) -> int:
    """Check a `GraphedGenerator.generate` request against ``runner``; returns its batch size.

    Raises:
        ValueError: naming the first argument out of range.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a [batch, prompt] int64 tensor")
    batch, prompt = input_ids.shape
    if input_ids.device != runner.device:
        raise ValueError(f"input_ids are on {input_ids.device}, the model on {runner.device}")
    if not 1 <= batch <= runner.buckets[-1] or prompt < 1:
        raise ValueError(f"batch must be in [1, {runner.buckets[-1]}] with a prompt, got {tuple(input_ids.shape)}")
    vocab = runner.model.get_input_embeddings().num_embeddings
    low, high = int(input_ids.min()), int(input_ids.max())  # one sync per request, before any work
    if low < 0 or high >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}) (the model's vocabulary), got {low}..{high}")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    if prompt + max_new_tokens > runner.max_length:
        raise ValueError(
            f"prompt ({prompt}) + max_new_tokens ({max_new_tokens}) exceeds max_length {runner.max_length}"
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be shaped like input_ids {tuple(input_ids.shape)}")
    if not temperature > 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature > 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    return batch


@dataclass(slots=True)
class Stop:
    """EOS bookkeeping as ``generate`` does it: a finished sequence emits ``pad`` from then on."""

    eos: torch.Tensor | None  # [n] int64 EOS ids, or None: never stop early
    pad: int
    finished: torch.Tensor  # [bucket] bool
    batch: int  # the real rows (the rest pad the bucket)

    @classmethod
    def of(cls, eos_token_id, pad_token_id, size: int, batch: int, device: torch.device) -> Stop:
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
