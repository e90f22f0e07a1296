"""Scaled-down MoE models with random weights, built from transformers' own config classes.

No download: the demo, the tests and the benchmarks build the same architecture as a real
checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS) at a size of their
choosing. The table below only translates one set of sizes into each config class's field
names; the cache itself finds expert blocks without any table (see `discovery`).

Weights are drawn with standard deviation ``init_std`` (0.3 by default, not transformers'
0.02): at 0.02 greedy decoding of a random model falls into repeating one token, which routes
to the same experts at every step, a best case for a cache. At 0.3 the tokens vary and the
routing is close to uniform, so hit rates measured on these models are a worst case; real
models route with strong skew.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: The families the integration is tested on.
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


@dataclass(frozen=True, slots=True)
class ModelSizes:
    """Sizes of a random model (``hidden != 2 * intermediate`` keeps the layouts unambiguous)."""

    num_moe_layers: int = 2
    num_experts: int = 8
    top_k: int = 2
    hidden: int = 32
    intermediate: int = 24
    vocab: int = 128
    heads: int = 4
    head_dim: int = 8


def _common(s: ModelSizes) -> dict:
    return {
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "num_hidden_layers": s.num_moe_layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": max(1, s.heads // 2),
        "num_experts_per_tok": s.top_k,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _mixtral(s: ModelSizes):
    from transformers import MixtralConfig

    return MixtralConfig(
        **_common(s),
        intermediate_size=s.intermediate,
        num_local_experts=s.num_experts,
        head_dim=s.head_dim,
    )


def _qwen2_moe(s: ModelSizes):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **_common(s),
        intermediate_size=s.intermediate,
        moe_intermediate_size=s.intermediate,
        shared_expert_intermediate_size=s.intermediate,
        num_experts=s.num_experts,
    )


def _qwen3_moe(s: ModelSizes):
    from transformers import Qwen3MoeConfig

    undeclared: dict[str, Any] = {"head_dim": s.head_dim}  # not a field; the model reads it
    return Qwen3MoeConfig(**_common(s), moe_intermediate_size=s.intermediate, num_experts=s.num_experts, **undeclared)


def _olmoe(s: ModelSizes):
    from transformers import OlmoeConfig

    return OlmoeConfig(**_common(s), intermediate_size=s.intermediate, num_experts=s.num_experts)


def _deepseek_v3(s: ModelSizes):
    from transformers import DeepseekV3Config

    common = _common(s)
    common["num_hidden_layers"] = s.num_moe_layers + 1  # the first layer is dense
    common["num_key_value_heads"] = s.heads  # multi-head latent attention: one kv head per head
    groups = 2 if s.num_experts % 2 == 0 else 1
    return DeepseekV3Config(
        **common,
        intermediate_size=2 * s.intermediate,
        moe_intermediate_size=s.intermediate,
        n_routed_experts=s.num_experts,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=groups,
        topk_group=groups,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=s.head_dim,
        qk_nope_head_dim=s.head_dim,
        v_head_dim=s.head_dim,
    )


def _gpt_oss(s: ModelSizes):
    from transformers import GptOssConfig

    common = _common(s)
    common["max_position_embeddings"] = 131072  # matches its YaRN factor (32 x 4096): no warning
    return GptOssConfig(
        **common,
        intermediate_size=s.intermediate,
        num_local_experts=s.num_experts,
        head_dim=s.head_dim,
    )


_BUILDERS: dict[str, Callable[[ModelSizes], Any]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}


#: Standard deviation of the random weights (see the module docstring).
INIT_STD = 0.3


def random_config(family: str, sizes: ModelSizes | None = None, *, init_std: float = INIT_STD):
    """The transformers config of a scaled-down ``family`` model.

    Raises:
        ValueError: an unknown family (the message lists the known ones).
    """
    try:
        builder = _BUILDERS[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}") from None
    config = builder(sizes or ModelSizes())
    config.initializer_range = init_std
    return config


def random_model(
    family: str,
    sizes: ModelSizes | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    init_std: float = INIT_STD,
):
    """A ``*ForCausalLM`` of ``family`` with seeded random weights, in eval mode.

    Args:
        family: one of `FAMILIES`.
        sizes: the model's sizes (default `ModelSizes()`: 2 MoE layers, 8 experts, top-2).
        seed: the weights' seed.
        dtype: parameter dtype.
        device: where to build the weights.
        init_std: standard deviation of the random weights.
    """
    from transformers import AutoModelForCausalLM

    config = random_config(family, sizes, init_std=init_std)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
