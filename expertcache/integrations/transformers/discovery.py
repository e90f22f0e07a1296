"""Finding the routed-expert blocks of a transformers model from its module and parameter names.

transformers 5.x stores a block's experts as 3-D parameters on one module whose class is
decorated with ``@use_experts_implementation``::

    gate_up_proj       [E, 2I, H]  (or [E, H, 2I] when the class says is_transposed)
    down_proj          [E, H, I]   (or [E, I, H])
    gate_up_proj_bias  [E, 2I]     optional (has_bias, GPT-OSS)
    down_proj_bias     [E, H]      optional

Quantized blocks qualify the same way, their packed tensors being per-expert parameters like
any other: transformers' ``FP8Experts`` (``gate_up_proj`` float8 ``[E, 2I, H]`` beside
``gate_up_proj_scale_inv``, ...) and `packed_models.Mxfp4Experts` (uint8 blocks and e8m0 scales).

Any module with those parameters is a block the cache can serve, whatever the model; shared
experts (plain MLPs) and routers do not match and stay where they are. A module that looks
like experts (named ``experts``, or a class named ``*Experts``) but cannot be served makes the
whole model unsupported, with an error naming the family: never a partly cached model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch
from torch import nn

#: Names the cache gives the host's tensors (``w1``/``w2`` are what `CachedWeightProvider`
#: requires; every other per-expert tensor keeps its own name and travels in ``extra``).
CACHE_NAMES = {"gate_up_proj": "w1", "down_proj": "w2"}


class UnsupportedModelError(ValueError):
    """The model has expert blocks that the transformers integration cannot serve.

    Attributes:
        family: the model's ``config.model_type``.
        reasons: ``(module name, class name, reason)`` for each block that cannot be served.
    """

    def __init__(self, family: str, reasons: list[tuple[str, str, str]]) -> None:
        self.family = family
        self.reasons = reasons
        name, cls, why = reasons[0]
        more = f" (and {len(reasons) - 1} more blocks)" if len(reasons) > 1 else ""
        super().__init__(
            f"model family {family!r} is not supported by the expert cache: {name} ({cls}) {why}"
            f"{more}. Supported: experts stored as 3-D gate_up_proj/down_proj parameters on a "
            f"class decorated with transformers' @use_experts_implementation (Mixtral, Qwen2-MoE, "
            f"Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ...)"
        )


class NoExpertsError(ValueError):
    """The model has no routed-expert (MoE) blocks at all."""

    def __init__(self, family: str) -> None:
        self.family = family
        super().__init__(
            f"model family {family!r} has no MoE layers (no module holds 3-D gate_up_proj and "
            f"down_proj expert parameters): there is nothing for the expert cache to serve"
        )


@dataclass(frozen=True)
class ExpertBlock:
    """One routed-expert module of a model.

    Attributes:
        name: qualified module name, e.g. ``"model.layers.3.mlp.experts"``.
        module: the experts module.
        layer: model layer index (the last integer in ``name``; else the block's position).
        num_experts: ``E``, the first dimension of every per-expert tensor.
        parameter_names: the module's per-expert parameters, ``gate_up_proj`` and
            ``down_proj`` first.
    """

    name: str
    module: nn.Module
    layer: int
    num_experts: int
    parameter_names: tuple[str, ...]

    def cache_name(self, parameter_name: str) -> str:
        """The name a parameter is registered under in the cache (``w1``, ``w2`` or its own)."""
        return CACHE_NAMES.get(parameter_name, parameter_name)


def model_family(model: nn.Module) -> str:
    """``config.model_type`` of a transformers model, else its class name."""
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", None) or type(model).__name__)


def find_expert_blocks(model: nn.Module) -> list[ExpertBlock]:
    """Every routed-expert block of ``model``, in module order.

    Raises:
        UnsupportedModelError: some block looks like experts but cannot be served.
        NoExpertsError: the model has no expert blocks.
    """
    blocks: list[ExpertBlock] = []
    problems: list[tuple[str, str, str]] = []
    for name, module in model.named_modules():
        parameters = dict(module.named_parameters(recurse=False))
        if not _looks_like_experts(name, module, parameters):
            continue
        reason = _unsupported_reason(module, parameters)
        if reason is not None:
            problems.append((name or "<model>", type(module).__name__, reason))
            continue
        blocks.append(_block(name, module, parameters, position=len(blocks)))
    family = model_family(model)
    if problems:
        raise UnsupportedModelError(family, problems)
    if not blocks:
        raise NoExpertsError(family)
    if len({block.layer for block in blocks}) != len(blocks):  # e.g. two towers: number in order
        blocks = [replace(block, layer=position) for position, block in enumerate(blocks)]
    return blocks


def _looks_like_experts(name: str, module: nn.Module, parameters: dict) -> bool:
    stacked = "down_proj" in parameters and ("gate_up_proj" in parameters or "up_proj" in parameters)
    named = name.rsplit(".", 1)[-1] == "experts" or type(module).__name__.endswith("Experts")
    return stacked or named


#: What to do with transformers' MXFP4 GPT-OSS experts, which the cache cannot serve as they are.
MXFP4_HINT = (
    "is transformers' MXFP4 GPT-OSS experts module, which runs only through the hub's "
    "gpt-oss-triton-kernels on swizzled tensors and not through an experts registry: load with "
    "Mxfp4Config(dequantize=True) and call expertcache.integrations.transformers.quantized."
    "load_mxfp4_experts(model, checkpoint) to serve the packed MXFP4 tensors"
)


def _unsupported_reason(module: nn.Module, parameters: dict[str, torch.Tensor]) -> str | None:
    if type(module).__name__ == "Mxfp4GptOssExperts":
        return MXFP4_HINT
    gate_up, down = parameters.get("gate_up_proj"), parameters.get("down_proj")
    if "up_proj" in parameters and gate_up is None:
        return "has experts without a gate (up_proj only), which the cache does not describe"
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return "does not store its experts as 3-D gate_up_proj and down_proj parameters"
    decorated = getattr(type(module).forward, "__wrapped__", None) is not None
    if not decorated or not hasattr(module, "is_transposed"):
        return "does not dispatch through transformers' @use_experts_implementation registry"
    buffers = [buffer_name for buffer_name, _ in module.named_buffers(recurse=False)]
    if buffers:
        return f"holds buffers {buffers} beside its expert parameters, which the cache does not move"
    num_experts = gate_up.shape[0]
    for parameter_name, parameter in parameters.items():
        if parameter.dim() == 0 or parameter.shape[0] != num_experts:
            shape = tuple(parameter.shape)
            return f"holds {parameter_name} {shape}, which is not one row per expert ({num_experts})"
    return None


def _block(name: str, module: nn.Module, parameters: dict, *, position: int) -> ExpertBlock:
    ordered = ["gate_up_proj", "down_proj"] + sorted(p for p in parameters if p not in CACHE_NAMES)
    digits = [int(part) for part in name.split(".") if part.isdigit()]
    return ExpertBlock(
        name=name,
        module=module,
        layer=digits[-1] if digits else position,
        num_experts=int(parameters["gate_up_proj"].shape[0]),
        parameter_names=tuple(ordered),
    )


def experts_interface_of(module: nn.Module):
    """The experts-function registry ``@use_experts_implementation`` gave the module's class.

    Returns None when the decorator's closure does not expose it (then transformers' global
    ``ALL_EXPERTS_FUNCTIONS`` is the one in use).
    """
    try:
        closure = inspect.getclosurevars(type(module).forward)
    except TypeError:
        return None
    return closure.nonlocals.get("experts_interface")
