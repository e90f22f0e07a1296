"""`ExpertCacheConfig`: the validated cache settings an engine or the CLI hands to an integration.

One dataclass carries what the ``--moe-*`` flags say (see `expertcache.cli.add_cache_arguments`)::

    cache_size        slots per MoE layer (vLLM RFC's --moe-expert-cache-size); with the
                      global budget the pool has cache_size * num_moe_layers slots in all
    policy            eviction policy name ("lru", ...; stored lower-case); simulation-only
                      (clairvoyant) policies such as "belady" are refused
    budget            "per-layer": a private pool of cache_size slots per layer;
                      "global": one pool shared by every layer, keys (layer, expert)
    pin_budget_bytes  refuse to pin more host memory than this (None: no limit)
    device            where the slots live (None: where the expert weights are); "cpu" or
                      "cuda[:N]", stored as torch spells it ("cpu:0" becomes "cpu")
    mode              "host": admission on the host, any policy (default);
                      "device": admission on the GPU (LRU), CUDA-graph capturable, no host
                      sync but for an eager prefill (one a pass, to copy with the engine)
    compression       None (default: experts stored as they are) or "exponent": bf16/fp16
                      experts stored losslessly exponent-coded (`expertcache.compression`,
                      ~0.68 of the bytes for bf16; PCIe carries the coded bytes, the slots
                      receive the exact weights); "none" is stored as None

Checks that need the model (the router's top-k that its config states, `config_top_k`;
cache_size against it and the number of experts, `cache_size_range`; that the experts are
bf16 or fp16 when compression is "exponent") happen when the cache is enabled; everything
that can be checked without it is checked here. Whether this machine can run a mode
(`check_mode_runs_here`) is a separate check, made by the command line before any model
is loaded.
"""

from __future__ import annotations

import numbers
import operator
import re
from dataclasses import dataclass
from fractions import Fraction

import torch

from expertcache.compression import COMPRESSIONS
from expertcache.policies import POLICIES
from expertcache.validation import check_device_index, check_int, check_pin_budget_bytes

#: Values of ``compression`` (and ``--moe-expert-cache-compression``); "none" means None.
COMPRESSION_CHOICES = ("none", *COMPRESSIONS)

#: The two ways to split the slots among layers.
BUDGETS = ("per-layer", "global")

#: Where admission decisions are made (see `expertcache.cached_provider`).
MODES = ("host", "device")

#: Policies a running cache can use: every known one but the clairvoyant (simulation-only).
RUNTIME_POLICY_NAMES = tuple(sorted(name for name, policy in POLICIES.items() if not policy.clairvoyant))

#: Slot ids are int32: at most this many slots per layer.
MAX_CACHE_SIZE = 2**31 - 1

#: The largest byte size `parse_byte_size` accepts by default: 2**53 (8 PiB), the last
#: integer a float represents exactly, so a size never changes on its way to a float.
MAX_BYTE_SIZE = 2**53

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
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
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
    compression: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_size", _check_count("cache_size", self.cache_size, "slots per MoE layer"))
        object.__setattr__(self, "policy", _runtime_policy(self.policy))
        _check_choice("mode", self.mode, MODES)
        if self.mode == "device" and self.policy != "lru":
            raise ValueError(f"mode 'device' implements only the lru policy, got {self.policy!r}")
        _check_choice("budget", self.budget, BUDGETS)
        object.__setattr__(self, "pin_budget_bytes", check_pin_budget_bytes(self.pin_budget_bytes))
        if self.device is not None:
            object.__setattr__(self, "device", _device_name(self.device))
        if self.compression is not None:
            _check_choice("compression", self.compression, COMPRESSION_CHOICES)
            object.__setattr__(self, "compression", None if self.compression == "none" else self.compression)


def cache_size_range(top_k: int, num_experts: int) -> range:
    """The cache sizes (slots per MoE layer) a model that routes each token to ``top_k`` of
    ``num_experts`` experts per layer accepts: ``top_k`` (one token's experts) to ``num_experts``.

    The one rule behind `expertcache.integrations.transformers.check_cache_size` and the sizes
    `expertcache.planner.plan` scores and recommends.
    """
    return range(top_k, num_experts + 1)


#: The field of a transformers model config that states the router's top-k.
TOP_K_FIELD = "num_experts_per_tok"


def config_top_k(model_config: object, num_experts: int) -> int:
    """The router's top-k that a model's config states (``num_experts_per_tok``), checked.

    A config that states none (no such field, or None) gives 1, the fewest experts a router
    picks: the bound `cache_size_range` needs, never a guess above what the model routes.

    Args:
        model_config: the config of a block's experts (a transformers config, or any object).
        num_experts: experts per MoE layer (the fewest, when layers differ).

    Raises:
        ValueError: the field is not a whole number (a bool, a float, a str) or is outside
            ``[1, num_experts]``: a top-k of 0 routes no token to any expert (a cache would
            report 100% hits of nothing), one above the experts routes to experts that do
            not exist. The message names the field and its value.
    """
    value = getattr(model_config, TOP_K_FIELD, None)
    if value is None:
        return 1
    top_k = operator.index(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else 0
    if not 1 <= top_k <= num_experts:  # 0: not a whole number, or a top-k of none
        raise ValueError(
            f"the model config's {TOP_K_FIELD} (the router's top-k) must be a whole number from 1 to "
            f"{num_experts} (the experts per layer), got {value!r:.40}"
        )
    return top_k


def _check_count(name: str, value: object, what: str) -> int:
    number = check_int(name, value)
    if not 1 <= number <= MAX_CACHE_SIZE:
        raise ValueError(f"{name} ({what}) must be between 1 and {MAX_CACHE_SIZE}, got {number}")
    return number


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _runtime_policy(policy: object) -> str:
    known = ", ".join(RUNTIME_POLICY_NAMES)
    if not isinstance(policy, str) or policy.lower() not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; known policies: {known}")
    name = policy.lower()
    if POLICIES[name].clairvoyant:
        raise ValueError(
            f"policy {name!r} is clairvoyant, for simulation only (expertcache.sim, expertcache plan); "
            f"a running cache can use: {known}"
        )
    return name


def _device_name(device: object) -> str:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str such as 'cuda:0' or None, got {type(device).__name__}")
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"not a device: {device!r} (expected 'cpu', 'cuda' or 'cuda:N')") from None
    check_device_index(device)
    if parsed.type == "cpu":
        if parsed.index not in (None, 0):  # as resolve_device: "cpu:1" would quietly mean the one CPU
            raise ValueError(f"device {device!r}: there is one CPU device ('cpu' or 'cpu:0')")
        return "cpu"
    if parsed.type != "cuda":
        raise ValueError(f"unsupported device {device!r}; the expert cache serves CUDA devices or the CPU")
    return str(parsed)


def check_mode_runs_here(mode: str, device: str | torch.device | None = None) -> None:
    """Refuse a mode this machine cannot run, before a model is loaded.

    ``"device"`` admits with Triton kernels: it needs a CUDA device, or ``TRITON_INTERPRET=1``
    to interpret the kernels on the CPU (slowly; the tests do).

    Args:
        mode: ``"host"`` or ``"device"``.
        device: where the slots will live (None: CUDA if present).

    Raises:
        ValueError: ``mode`` is ``"device"`` and the kernels cannot run there.
    """
    if mode != "device":
        return
    from expertcache.validation import check_mode_device, resolve_device

    check_mode_device(resolve_device(device))


def parse_byte_size(text: str, *, maximum: int = MAX_BYTE_SIZE) -> int:
    """Bytes in a size such as ``"64GiB"``, ``"500 MB"``, ``"1.5gb"`` or ``"1048576"``.

    Decimal units (kB, MB, GB, TB, PB) are powers of 1000, binary ones (KiB ... PiB)
    powers of 1024. The number is read exactly (no float): a fraction of a byte is dropped.

    Args:
        text: the size.
        maximum: the largest size accepted (default 2**53 bytes).

    Raises:
        ValueError: not a size, or above ``maximum``.
    """
    if not isinstance(text, str):
        raise TypeError(f"a byte size is a str such as '64GiB', got {type(text).__name__}")
    shown = repr(text) if len(text) <= 40 else repr(text[:40]) + "..."
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text) if len(text) <= 400 else None
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a byte size: {shown} (examples: 1048576, 500MB, 64GiB)")
    size = Fraction(match.group(1)) * _UNITS[unit]
    if size > maximum:
        raise ValueError(f"byte size {shown} is more than {maximum} bytes ({maximum / 2**50:g} PiB), the most accepted")
    return int(size)
