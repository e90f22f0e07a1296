"""Builders shared by the transformers-integration tests: tiny models, prompts, logits."""

from __future__ import annotations

import torch

from expertcache.integrations.transformers.random_models import ModelSizes, random_model

#: >= 2 MoE layers, >= 8 experts, top-2; caches in the tests hold fewer than 8 experts.
TINY = ModelSizes(num_moe_layers=2, num_experts=8, top_k=2)

NEW_TOKENS = 16


def tiny_model(family: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    return random_model(family, TINY, dtype=dtype).to(device)


def prompt(length: int = 12, *, device: str = "cpu") -> torch.Tensor:
    """``[1, length]`` int64 token ids, seeded."""
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, TINY.vocab, (1, length), generator=generator).to(device)


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, T, vocab]`` fp32 logits of one forward pass over ``tokens``."""
    with torch.no_grad():
        return model(tokens).logits.float()
