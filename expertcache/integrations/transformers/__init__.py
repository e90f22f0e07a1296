"""Hugging Face transformers (5.x) integration: serve a model's experts from the cache.

    handle = enable_expert_cache(model, cache_size=16)   # slots per MoE layer
    model.generate(...)                                  # outputs unchanged
    print(handle.stats.total.hit_rate)
    handle.disable()                                     # original weights back

`GraphedGenerator` decodes with each step one CUDA-graph replay (device-mode cache inside).
Importing this package registers the project's experts implementations with transformers
(``"expertcache"``, and ``"expertcache_quant"`` / ``"expertcache_dequant"`` of `quantized`).

Plugs in through transformers' own experts extension point (``@use_experts_implementation``
and its experts-function registry); expert blocks are found from module and parameter
names, not from a table of models.
"""

from expertcache.integrations.transformers.discovery import (
    ExpertBlock,
    NoExpertsError,
    UnsupportedModelError,
    find_expert_blocks,
)
from expertcache.integrations.transformers.dispatch import IMPLEMENTATION_NAME
from expertcache.integrations.transformers.graphed import GraphedGenerator
from expertcache.integrations.transformers.handle import (
    ExpertCacheHandle,
    ExpertCacheStats,
    check_cache_size,
    enable_expert_cache,
)
from expertcache.integrations.transformers.packed_models import load_mxfp4_experts, quantize_experts
from expertcache.integrations.transformers.quantized import (  # importing registers them
    DEQUANT_IMPLEMENTATION,
    QUANT_IMPLEMENTATION,
)

__all__ = [
    "DEQUANT_IMPLEMENTATION",
    "IMPLEMENTATION_NAME",
    "QUANT_IMPLEMENTATION",
    "ExpertBlock",
    "ExpertCacheHandle",
    "ExpertCacheStats",
    "GraphedGenerator",
    "NoExpertsError",
    "UnsupportedModelError",
    "check_cache_size",
    "enable_expert_cache",
    "find_expert_blocks",
    "load_mxfp4_experts",
    "quantize_experts",
]
