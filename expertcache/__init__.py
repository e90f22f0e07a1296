"""expertcache: run Mixture-of-Experts models on GPUs too small for their expert weights.

Every expert lives in pinned host memory; a fixed-address pool of GPU slots holds the
hottest ones. Before each fused-MoE call a provider turns the router's ``topk_ids`` into
slot ids, copying misses in and evicting cold experts::

    router -> topk_ids -> provider.prepare(topk_ids) -> ExpertWeightResult -> fused MoE kernel
                          plan (host policy | device LRU), move (copies), commit + remap

The cache is a weight provider, not a second forward path.
"""

from expertcache.cached_provider import CachedWeightProvider
from expertcache.errors import CacheCapacityError, ConcurrentUseError, PinBudgetError
from expertcache.provider import ExpertWeightProvider, FullGPUProvider
from expertcache.result import ExpertWeightResult
from expertcache.slot_pool import SlotPool
from expertcache.stats import CacheStats

__version__ = "0.1.0"

__all__ = [
    "CacheCapacityError",
    "CacheStats",
    "CachedWeightProvider",
    "ConcurrentUseError",
    "ExpertWeightProvider",
    "ExpertWeightResult",
    "FullGPUProvider",
    "PinBudgetError",
    "SlotPool",
    "__version__",
]
