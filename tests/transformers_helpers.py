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


def multimodal_config():
    """A tiny Qwen3-VL-MoE config: the experts under ``text_config``, a sub-config of the model's."""
    from transformers import Qwen3VLMoeConfig

    text = {
        "vocab_size": TINY.vocab, "hidden_size": TINY.hidden, "intermediate_size": 2 * TINY.intermediate,
        "moe_intermediate_size": TINY.intermediate, "num_hidden_layers": TINY.num_moe_layers,
        "num_attention_heads": TINY.heads, "num_key_value_heads": TINY.heads // 2, "head_dim": TINY.head_dim,
        "num_experts": TINY.num_experts, "num_experts_per_tok": TINY.top_k,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    }  # fmt: skip
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": TINY.hidden,
              "deepstack_visual_indexes": [0]}  # fmt: skip
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision)
