"""`GraphedGenerator`'s batch buckets: their static buffers and the model calls made on them.

A batch runs in the smallest bucket that holds it (`bucket_sizes`: 1, 2, 4, ... up to
``max_batch_size``), padded up to the bucket's size. Each `Bucket` keeps, for the
generator's lifetime, the buffers its decode step reads (addresses fixed, so a CUDA graph
captured on them replays) and, once `graph_capture` captured it, the graph and its logits.
`StepCalls` makes the two model calls on a bucket: `StepCalls.prefill` runs the prompts
into its ``StaticCache`` eagerly, `StepCalls.forward` is the single-token step (the one a
graph captures), handing eager attention the additive mask built from device tensors only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch


def bucket_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The batch buckets: powers of two below ``max_batch_size``, then ``max_batch_size``."""
    sizes = [1 << n for n in range(max_batch_size.bit_length()) if 1 << n < max_batch_size]
    return (*sizes, max_batch_size)


@dataclass(slots=True)
class Bucket:
    """Static buffers of one batch bucket (addresses fixed for the generator's lifetime)."""

    size: int
    cache: Any  # transformers StaticCache
    input_ids: torch.Tensor  # [size, 1] int64
    position_ids: torch.Tensor  # [size, 1] int64
    attention_mask: torch.Tensor  # [size, max_length] int64
    warm_steps: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [size, V], the graph's output
    addresses: Any = None  # graph_capture.Addresses: what the graph reads outside these buffers


@dataclass(frozen=True, slots=True)
class StepCalls:
    """The model calls on a bucket's buffers (`of` reads what they depend on from the model)."""

    model: Any
    max_length: int
    device: torch.device
    cache_kwarg: str  # the forward's name for the cache: "cache" or "past_key_values"
    additive_mask: bool  # hand the step the 4D additive mask (eager attention)
    mask_dtype: torch.dtype

    @classmethod
    def of(cls, model: Any, max_length: int, device: torch.device) -> StepCalls:
        cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # transformers' eager attention builds its additive mask with a host scalar copied to
        # the GPU (5.17), which a capture refuses: the step hands it the finished 4D mask
        additive_mask = getattr(model.config, "_attn_implementation", None) == "eager"
        mask_dtype = model.get_input_embeddings().weight.dtype
        return cls(model, max_length, device, cache_kwarg, additive_mask, mask_dtype)

    def prefill(self, state: Bucket, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
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
        kwargs = {self.cache_kwarg: state.cache}
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1, **kwargs
        )
        state.attention_mask.fill_(1)
        state.attention_mask[:, : mask.shape[1]].copy_(mask)
        state.position_ids.copy_(positions[:, -1:])
        return out.logits[:, -1]

    def step_mask(self, state: Bucket) -> torch.Tensor:
        """The decode step's attention mask: the ``[b, max_length]`` padding mask, or for eager
        attention the ``[b, 1, 1, max_length]`` additive mask transformers would build from it
        (0 where a row may attend: not padding and at most the cache's length; else the
        dtype's minimum), from device tensors only, so the graph recomputes it each replay."""
        length = state.cache.get_seq_length()
        if not self.additive_mask or not isinstance(length, torch.Tensor):
            return state.attention_mask
        positions = torch.arange(self.max_length, device=self.device)
        keep = state.attention_mask.bool() & (positions <= length.to(self.device))
        blocked = torch.full_like(keep, torch.finfo(self.mask_dtype).min, dtype=self.mask_dtype)
        return torch.where(keep, torch.zeros_like(blocked), blocked)[:, None, None, :]

    def forward(self, state: Bucket) -> torch.Tensor:
        """The single-token decode step on the bucket's buffers: ``[bucket, V]`` logits."""
        kwargs = {self.cache_kwarg: state.cache}
        out = self.model(
            input_ids=state.input_ids,
            attention_mask=self.step_mask(state),
            position_ids=state.position_ids,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1]
