"""`ExpertCacheConfig`: the validated cache settings an engine or the CLI hands to an integration.

One dataclass carries what the ``--moe-*`` flags say (see `expertcache.cli.add_cache_arguments`)::

    cache_size        slots per MoE layer (vLLM RFC's --moe-expert-cache-size); with the
                      global budget the pool has cache_size * num_moe_layers slots in all
    policy            eviction policy name ("lru", ...)
    budget            "per-layer": a private pool of cache_size slots per layer;
                      "global": one pool shared by every layer, keys (layer, expert)
    pin_budget_bytes  refuse to pin more host memory than this (None: no limit)
    device            where the slots live (None: where the expert weights are)
    mode              "host": admission on the host, any policy (default);
                      "device": admission on the GPU (LRU), no host sync, CUDA-graph capturable

Checks that need the model (cache_size against the number of experts) happen when the cache
is enabled; everything that can be checked without it is checked here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from expertcache.policies import POLICIES

#: The two ways to split the slots among layers.
BUDGETS = ("per-layer", "global")

#: Where admission decisions are made (see `expertcache.cached_provider`).
MODES = ("host", "device")

#: The default budget. Chosen from replays of the real traces in ``shared/traces``
#: (``benchmarks/budget_replay.py``; the figures are in the README): see the README.
DEFAULT_BUDGET = "global"

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True, slots=True)
class ExpertCacheConfig:
    """Settings of an expert cache (see the module docstring for each field).

    Raises:
        TypeError / ValueError: on construction, for a field of the wrong type or value.
    """

    cache_size: int
    policy: str = "lru"
    budget: str = DEFAULT_BUDGET
    pin_budget_bytes: int | None = None
    device: str | None = None
    mode: str = "host"

    def __post_init__(self) -> None:
        if not isinstance(self.cache_size, int) or isinstance(self.cache_size, bool):
            raise TypeError(f"cache_size must be an int, got {type(self.cache_size).__name__}")
        if self.cache_size < 1:
            raise ValueError(f"cache_size (slots per MoE layer) must be at least 1, got {self.cache_size}")
        if not isinstance(self.policy, str) or self.policy.lower() not in POLICIES:
            known = ", ".join(sorted(POLICIES))
            raise ValueError(f"unknown eviction policy {self.policy!r}; known policies: {known}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "device" and self.policy.lower() != "lru":
            raise ValueError(f"mode 'device' implements only the lru policy, got {self.policy!r}")
        if self.budget not in BUDGETS:
            raise ValueError(f"budget must be one of {', '.join(BUDGETS)}, got {self.budget!r}")
        pin = self.pin_budget_bytes
        if pin is not None and (not isinstance(pin, int) or isinstance(pin, bool) or pin < 0):
            raise ValueError(f"pin_budget_bytes must be a non-negative int or None, got {pin!r}")


def parse_byte_size(text: str) -> int:
    """Bytes in a size such as ``"64GiB"``, ``"500 MB"``, ``"1.5gb"`` or ``"1048576"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB)
    powers of 1024.

    Raises:
        ValueError: not a size.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 1048576, 500MB, 64GiB)")
    return int(float(match.group(1)) * _UNITS[unit])
