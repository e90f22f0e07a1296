"""An experts module's packed tensors under the names of `expertcache.quant`, and their scheme.

`packed_operands` reads what the kernels and the pure-torch reference of `quantized` compute
on (``w1``, ``w2``, their scales and biases) from an experts module or a `SlotView` of its
slots, in any of the three layouts `quantized` describes: transformers' ``FP8Experts``
(block or per-tensor scales, put on one block grid for both projections: `fp8_block_of`,
`on_block_grid`), `packed_models.Mxfp4Experts`, and float ``[E, 2I, H]`` SwiGLU experts
(format "none"). It raises ValueError, naming the module, for what they do not compute;
`is_quantized` tells packed experts from float ones. `quantized` re-exports the public names.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from expertcache.integrations.transformers.slot_view import SlotView
from expertcache.quant import QuantScheme
from expertcache.quant_mxfp4 import GROUP


def is_quantized(module: nn.Module) -> bool:
    """Whether an experts module holds packed (FP8 or MXFP4) weights."""
    weight = getattr(module, "gate_up_proj", None)
    return isinstance(weight, torch.Tensor) and weight.element_size() == 1


def packed_operands(module) -> tuple[dict[str, torch.Tensor], QuantScheme]:
    """The module's packed tensors under the names of `expertcache.quant` and their scheme.

    Args:
        module: an FP8 or MXFP4 experts module, or a `SlotView` of one (then ``[N, ...]``
            slot tensors).

    Returns:
        ``({"w1", "w2", "w1_scale", "w2_scale"[, "w1_bias", "w2_bias"]}, scheme)``; FP8
        scales are put on one block grid for both projections (see `_fp8_operands`).

    Raises:
        ValueError: a format or activation the kernels do not compute.
    """
    if getattr(module, "gate_up_proj_scales", None) is not None:
        return _mxfp4_operands(module)
    if getattr(module, "gate_up_proj_scale_inv", None) is not None:
        return _fp8_operands(module)
    return _float_operands(module)


def _float_operands(module) -> tuple[dict[str, torch.Tensor], QuantScheme]:
    """Float experts of the ``[E, 2I, H]`` / ``[E, H, I]`` layout (Qwen3-MoE, DeepSeek-V3,
    Mixtral, OLMoE, Qwen2-MoE) with SwiGLU: format "none" of the same kernels."""
    name = _class_name(module)
    weight = getattr(module, "gate_up_proj", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise ValueError(f"{name} holds no FP8 (*_scale_inv) or MXFP4 (*_scales) expert scales and no float "
                         f"gate_up_proj")  # fmt: skip
    unlike = _unlike_plain_swiglu(module)
    if unlike:
        raise ValueError(f"float {name} ({unlike}): only [E, 2I, H] experts with transformers' default SwiGLU, "
                         f"without biases, are computed here; select one of transformers' implementations "
                         f"(GPT-OSS keeps x @ W)")  # fmt: skip
    return {"w1": weight, "w2": module.down_proj}, QuantScheme("none")


def _unlike_plain_swiglu(module) -> str:
    """What makes a float experts module compute other than ``silu(x W_g) * (x W_u) W_d``:
    an empty string when nothing does."""
    from transformers.integrations import moe

    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if act != "silu":
        return f"activation {act!r}"
    flags = [flag for flag in ("has_bias", "is_transposed", "has_post_expert_norm") if getattr(module, flag, False)]
    flags += [name for name in ("swiglu_limit", "gate_softcap", "up_softcap") if getattr(module, name, None)]
    if not getattr(module, "has_gate", True):
        flags.append("no gate")
    gate = inspect.getattr_static(_unwrapped_class(module), "_apply_gate", None)
    if gate is not None and gate is not getattr(moe, "_default_apply_gate", gate):
        flags.append("its own _apply_gate")
    return ", ".join(flags)


def _unwrapped_class(module) -> type:
    return type(object.__getattribute__(module, "_module")) if isinstance(module, SlotView) else type(module)


def _class_name(module) -> str:
    return _unwrapped_class(module).__name__


def _fp8_operands(module) -> tuple[dict[str, torch.Tensor], QuantScheme]:
    if not getattr(module, "has_gate", True) or getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise ValueError("only gated FP8 experts with dynamic activation scales are computed here")
    act = getattr(module.config, "hidden_act", "silu")
    variants = [name for name in ("swiglu_limit", "gate_softcap") if getattr(module, name, None) is not None]
    if act != "silu" or variants:
        raise ValueError(f"FP8 experts with activation {act!r} {variants} are not computed here (SwiGLU only)")
    w1, w2 = module.gate_up_proj, module.down_proj
    s1, s2 = module.gate_up_proj_scale_inv, module.down_proj_scale_inv
    if s1.dtype != torch.float32 or s2.dtype != torch.float32:
        raise ValueError(f"FP8 scales must be float32 (ue8m0 is not computed here), got {s1.dtype}")
    block = fp8_block_of(w1, s1, module.block_size)
    return {"w1": w1, "w2": w2, "w1_scale": s1, "w2_scale": on_block_grid(w2, s2, block)}, QuantScheme(
        "fp8", fp8_block=block
    )


def fp8_block_of(weight: torch.Tensor, scale: torch.Tensor, block_size) -> tuple[int, int]:
    """The ``(rows, columns)`` each scale of ``weight`` ``[N, R, C]`` covers: the module's
    ``block_size`` when the grid is ``ceil`` of it, else the exact division of the grid
    (transformers' per-tensor gate_up keeps ``[2, 1]``: gate and up halves apart)."""
    rows, cols = weight.shape[-2:]
    grid = tuple(scale.shape[-2:])
    if block_size is not None and grid == (-(-rows // block_size[0]), -(-cols // block_size[1])):
        return int(block_size[0]), int(block_size[1])
    if rows % grid[0] or cols % grid[1]:
        raise ValueError(f"scale grid {list(grid)} does not tile weight [{rows}, {cols}] (block {block_size})")
    return rows // grid[0], cols // grid[1]


def on_block_grid(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``scale`` of ``weight`` ``[N, R, C]`` on the grid of ``block`` (the kernels take one
    block for both projections): as it is, or a per-tensor ``[N, 1, 1]`` repeated."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape[-2:]) == grid:
        return scale
    if tuple(scale.shape[-2:]) == (1, 1):
        return scale.expand(*scale.shape[:-2], *grid).contiguous()
    raise ValueError(f"down_proj scales {list(scale.shape)} are on another block grid than gate_up_proj's {block}")


def _mxfp4_operands(module) -> tuple[dict[str, torch.Tensor], QuantScheme]:
    w1, w2 = module.gate_up_proj, module.down_proj
    s1, s2 = module.gate_up_proj_scales, module.down_proj_scales
    tensors = {
        "w1": w1.view(*s1.shape, GROUP // 2),
        "w2": w2.view(*s2.shape, GROUP // 2),
        "w1_scale": s1,
        "w2_scale": s2,
        "w1_bias": module.gate_up_proj_bias,
        "w2_bias": module.down_proj_bias,
    }
    scheme = QuantScheme("mxfp4", gate_up="interleaved", activation="swiglu_oai", alpha=module.alpha,
                         limit=module.limit, has_bias=True)  # fmt: skip
    return tensors, scheme
