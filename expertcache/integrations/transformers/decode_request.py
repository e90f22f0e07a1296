"""One `GraphedGenerator.generate` request: its checks, and its EOS bookkeeping.

`check_request` refuses, before any work, a request the generator cannot run as
``model.generate`` would (shapes, device, token ids outside the vocabulary, lengths past
the static caches, a mask that is not left padding of 0 and 1, sampling settings out of
range or given without ``do_sample``, EOS and pad ids that are not token ids); it returns
the request as a `Request`. `Stop` then follows, step by step, which sequences have emitted
an EOS id, as ``generate`` does: a finished one emits ``pad`` from then on, and decoding
ends when every real row (not the bucket's padding) has finished.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from expertcache.validation import check_flag, check_int, is_dense

if TYPE_CHECKING:
    from expertcache.integrations.transformers.graphed import GraphedGenerator


@dataclass(frozen=True, slots=True)
class Request:
    """A checked request: what `GraphedGenerator.generate` runs."""

    batch: int  # the real rows B
    max_new_tokens: int
    mask: torch.Tensor  # [B, P] int64 of 0 (left padding) and 1
    do_sample: bool
    eos: tuple[int, ...] | None  # token ids that end a sequence, or None: never stop early
    pad: int | None  # what a finished sequence emits (None: the first EOS id)


def check_request(
    runner: GraphedGenerator,
    input_ids,
    max_new_tokens,
    attention_mask,
    *,
    do_sample=False,
    temperature=1.0,
    top_p=1.0,
    generator=None,
    eos_token_id=None,
    pad_token_id=None,
) -> Request:
    """Check a `GraphedGenerator.generate` request against ``runner``, before any work.

    Raises:
        TypeError: an argument of the wrong type (naming it).
        ValueError: naming the first argument out of range, a sampling setting
            (``temperature``, ``top_p``, ``generator``) given without ``do_sample=True``, or
            ``pad_token_id`` without ``eos_token_id``.
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
    mask = check_attention_mask(attention_mask, input_ids)
    do_sample = check_flag("do_sample", do_sample)
    check_sampling(do_sample, temperature, top_p, generator, runner.device)
    eos = None if eos_token_id is None else token_ids("eos_token_id", eos_token_id, vocab)
    pad = None if pad_token_id is None else token_ids("pad_token_id", pad_token_id, vocab, several=False)[0]
    if pad is not None and eos is None:  # only finished sequences emit it
        raise ValueError(
            f"pad_token_id={pad} given without eos_token_id: no sequence can finish, so it would be ignored; "
            f"pass eos_token_id too, or drop pad_token_id"
        )
    return Request(batch, max_new_tokens, mask, do_sample, eos, pad)


def check_attention_mask(attention_mask: object, input_ids: torch.Tensor) -> torch.Tensor:
    """``attention_mask`` as ``[B, P]`` int64: 0/1 integers or bools shaped like ``input_ids``,
    on its device, each row left-padded (zeros, then ones: its last token real).

    Raises:
        TypeError: not a dense tensor of integers or bools. ValueError: its shape, device or values.
    """
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or not is_dense(attention_mask):
        raise TypeError(
            f"attention_mask must be a dense [batch, prompt] tensor of 0 and 1 (or None), got "
            f"{type(attention_mask).__name__}"
        )
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be shaped like input_ids {tuple(input_ids.shape)}")
    if attention_mask.device != input_ids.device:
        raise ValueError(f"attention_mask is on {attention_mask.device}, input_ids on {input_ids.device}")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise TypeError(
            f"attention_mask must hold integers or bools (1: token, 0: padding), got {attention_mask.dtype}"
        )
    mask = attention_mask.to(torch.long)
    not_binary = (mask != 0) & (mask != 1)
    empty = mask.sum(dim=1) == 0
    right_padded = mask[:, -1] == 0
    flags = torch.stack([not_binary.any(), empty.any(), right_padded.any()]).tolist()  # one sync
    if flags[0]:
        values = sorted(set(mask[not_binary].tolist()))[:4]
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got {values}")
    if flags[1]:
        raise ValueError(f"attention_mask row {int(empty.nonzero()[0])} has no token (all zeros)")
    if flags[2]:
        raise ValueError(
            f"attention_mask row {int(right_padded.nonzero()[0])} ends with padding: GraphedGenerator takes "
            f"left-padded prompts (zeros first, the last token real), as model.generate wants for decoder-only models"
        )
    return mask


def check_sampling(do_sample: bool, temperature: object, top_p: object, generator: object, device) -> None:
    """``temperature`` in (0, inf), ``top_p`` in (0, 1], ``generator`` None or a ``torch.Generator``
    on ``device``; without ``do_sample`` each must be left at its default (it would be ignored).

    Raises:
        TypeError: a setting of the wrong type. ValueError: out of range, or given without do_sample.
    """
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r:.40}")
    if not 0 < temperature < math.inf:  # type: ignore[operator]
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    if not 0 < top_p <= 1:  # type: ignore[operator]
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is not None and generator.device.type != torch.device(device).type:
        raise ValueError(f"generator is on {generator.device}, the model on {device}: sampling needs it there")
    if do_sample:
        return
    # both default to 1.0: an explicit 1.0 (or 1) changes nothing and is accepted
    ignored = [f"{name}={value!r}" for name, value in (("temperature", temperature), ("top_p", top_p)) if value != 1]
    ignored += [] if generator is None else ["generator"]
    if ignored:
        them = "it" if len(ignored) == 1 else "them"
        raise ValueError(
            f"{', '.join(ignored)} given with do_sample=False, which takes the argmax and would ignore {them}: "
            f"pass do_sample=True to sample, or drop {them}"
        )


def token_ids(name: str, value: object, vocab: int, *, several: bool = True) -> tuple[int, ...]:
    """``value`` (one token id, or with ``several`` a non-empty list or tuple of them) as a
    tuple of ints in ``[0, vocab)``.

    Raises:
        TypeError: not an integer (or a list of them). ValueError: empty, or outside the vocabulary.
    """
    expected = "a token id (an int) or a list of them" if several else "a token id (an int)"
    if several and isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{name} must name at least one token id, got an empty {type(value).__name__}")
        ids = tuple(check_int(name, item, expected=expected) for item in value)
    else:
        ids = (check_int(name, value, expected=expected),)
    outside = [item for item in ids if not 0 <= item < vocab]
    if outside:
        raise ValueError(f"{name} must be in [0, {vocab}) (the model's vocabulary), got {outside[0]}")
    return ids


@dataclass(slots=True)
class Stop:
    """EOS bookkeeping as ``generate`` does it: a finished sequence emits ``pad`` from then on."""

    eos: torch.Tensor | None  # [n] int64 EOS ids, or None: never stop early
    pad: int
    finished: torch.Tensor  # [bucket] bool
    batch: int  # the real rows (the rest pad the bucket)

    @classmethod
    def of(cls, request: Request, size: int, device: torch.device) -> Stop:
        eos = None if request.eos is None else torch.tensor(request.eos, dtype=torch.long, device=device)
        pad = request.pad if request.pad is not None else (request.eos[0] if request.eos is not None else 0)
        return cls(eos, pad, torch.zeros(size, dtype=torch.bool, device=device), request.batch)

    def update(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.eos is None:
            return tokens
        tokens = torch.where(self.finished, self.pad, tokens)
        self.finished |= torch.isin(tokens, self.eos)
        return tokens

    def all_finished(self) -> bool:
        # a host read per step, as generate() makes one; none without EOS ids
        return self.eos is not None and bool(self.finished[: self.batch].all())
