"""Quantized expert blocks of transformers models: what they compute with, and MXFP4 loading.

The cache serves packed experts as they are (any dtype per tensor, never dequantized in the
store or the slots); this module supplies what computes on them where transformers cannot:

    FP8Experts (transformers' finegrained FP8, Qwen3-FP8 / DeepSeek-V3 checkpoints)
      gate_up_proj           [E, 2I, H] float8_e4m3fn    gate_up_proj_scale_inv [E, 2I/bn, H/bk] fp32
      down_proj              [E, H, I]  float8_e4m3fn    down_proj_scale_inv    [E, H/bn, I/bk]  fp32
      (``block_size=None``, per-tensor: ``[E, 2, 1]`` (gate and up apart) and ``[E, 1, 1]``)
    `Mxfp4Experts` (GPT-OSS MXFP4, this module's; the checkpoint's layout, 3-D like transformers')
      gate_up_proj           [E, 2I, G(H)*16] uint8      gate_up_proj_scales    [E, 2I, G(H)] e8m0
      down_proj              [E, H, G(I)*16]  uint8      down_proj_scales       [E, H, G(I)]  e8m0
      gate_up_proj_bias      [E, 2I]                     down_proj_bias         [E, H]

transformers' own FP8 functions (``eager``, ``batched_mm``, ``grouped_mm``) need the
``kernels-community/finegrained-fp8`` hub kernel; where it loads they run on the slots as
any other implementation. Where it does not (no ``kernels`` package, no network, the CPU),
select one of the two registered here (``model.set_experts_implementation(name)``):

    "expertcache_quant"    the project's Triton apply kernels on the packed tensors
                           (`expertcache.kernels.quant_passes`); where they cannot launch (a
                           CPU without TRITON_INTERPRET=1) the reference below. Registered
                           for float experts too (``[E, 2I, H]`` SwiGLU families, format
                           "none"). Served, it takes every expert-group pass of a call at
                           once: bit-identical to the uncached call at any size (transformers'
                           own functions run once per pass, summed in fp32: close, not equal)
    "expertcache_dequant"  pure torch: dequantize the experts referenced, run the float MLP
                           (the dequantization transformers applies when it loads a
                           checkpoint with ``dequantize=True``)

transformers' MXFP4 GPT-OSS experts (``Mxfp4GptOssExperts``) run only through the hub's
``gpt-oss-triton-kernels`` on swizzled tensors and are not dispatched through an experts
registry; without those kernels transformers dequantizes the checkpoint to bf16. To serve
the packed bytes instead, `load_mxfp4_experts` replaces each GPT-OSS experts module by an
`Mxfp4Experts` holding the checkpoint's blocks and scales; it dispatches through
`MXFP4_EXPERTS_FUNCTIONS`, where ``eager`` is the reference and every other name the kernels.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface, use_experts_implementation

from expertcache.integrations.transformers.pass_runs import PassSummer
from expertcache.integrations.transformers.slot_view import SlotView
from expertcache.quant import QuantScheme, gated_moe_forward
from expertcache.quant_fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from expertcache.quant_mxfp4 import GROUP, dequantize_mxfp4, mxfp4_groups, quantize_mxfp4
from expertcache.result import ExpertWeightResult

QUANT_IMPLEMENTATION = "expertcache_quant"
DEQUANT_IMPLEMENTATION = "expertcache_dequant"


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


def dequant_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """Experts function: dequantize the experts ``top_k_index`` refers to and run the float
    MLP in fp32 (the pure-torch reference).

    Args:
        hidden_states: ``[T, H]``; top_k_index: ``[T, K]`` ids into the module's ``[N, ...]``
            tensors; top_k_weights: ``[T, K]``.

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype.
    """
    tensors, scheme = packed_operands(self)
    used, local = torch.unique(top_k_index, return_inverse=True)  # dequantize only these
    picked = {name: tensor.index_select(0, used) for name, tensor in tensors.items()}
    if scheme.format == "mxfp4":
        inter = picked["w1"].shape[1] // 2
        w1 = dequantize_mxfp4(picked["w1"], picked["w1_scale"], hidden_states.shape[1])
        w2 = dequantize_mxfp4(picked["w2"], picked["w2_scale"], inter)
    elif scheme.format == "none":  # float experts
        w1, w2 = picked["w1"].float(), picked["w2"].float()
    else:
        block = scheme.fp8_block or tuple(picked["w1"].shape[-2:])  # `_fp8_operands` always gives one
        w1 = dequantize_fp8_blocks(picked["w1"], picked["w1_scale"], block)  # type: ignore[arg-type]
        w2 = dequantize_fp8_blocks(picked["w2"], picked["w2_scale"], block)  # type: ignore[arg-type]
    out = gated_moe_forward(hidden_states.float(), w1, w2, top_k_weights.float(), local, scheme=scheme,
                            w1_bias=picked.get("w1_bias"), w2_bias=picked.get("w2_bias"))  # fmt: skip
    return out.to(hidden_states.dtype)


def quant_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """Experts function: the Triton apply kernels on the packed tensors (dequantized in
    registers, fp32 accumulation); `dequant_experts_forward` where they cannot launch.

    Same arguments and result as `dequant_experts_forward`.
    """
    from expertcache.kernels._launch import runs_on

    if not runs_on(hidden_states):
        return dequant_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    from expertcache.kernels.quant_passes import moe_apply_quant_passes

    tensors, scheme = packed_operands(self)
    result = _result(tensors, top_k_index)
    return moe_apply_quant_passes(hidden_states.contiguous(), [result], top_k_weights, scheme=scheme)


def quant_experts_passes(prepared, pass_ids, hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every pass of a served call through the Triton kernels at once
    (`moe_apply_quant_passes`): bit-identical to `quant_experts_forward` on the full weights.

    Args:
        prepared: `packed_operands` of the pool's `SlotView` (``[S, ...]`` slot tensors).
        pass_ids: per pass, ``[T, K]`` slot ids, -1 for other passes.
        hidden_states: ``[T, H]``; top_k_weights: ``[T, K]``.
    """
    from expertcache.kernels.quant_passes import moe_apply_quant_passes

    tensors, scheme = prepared
    results = (_result(tensors, ids) for ids in pass_ids)
    return moe_apply_quant_passes(hidden_states.contiguous(), results, top_k_weights, scheme=scheme)


def _result(tensors: dict[str, torch.Tensor], ids: torch.Tensor) -> ExpertWeightResult:
    """`packed_operands`' tensors as a kernel's `ExpertWeightResult` for ``ids``."""
    extra = {name: t for name, t in tensors.items() if name not in ("w1", "w2", "w1_scale", "w2_scale")}
    return ExpertWeightResult(tensors["w1"], tensors["w2"], ids, w1_scale=tensors.get("w1_scale"),
                              w2_scale=tensors.get("w2_scale"), extra=extra)  # fmt: skip


def _kernels_run_on(hidden_states: torch.Tensor) -> bool:
    from expertcache.kernels._launch import runs_on

    return runs_on(hidden_states)


def _check_computable(view) -> None:
    packed_operands(view)  # raises ValueError naming what it does not compute


quant_experts_forward.sums_passes = PassSummer(  # type: ignore[attr-defined]
    applies=_kernels_run_on, prepare=packed_operands, run=quant_experts_passes
)
quant_experts_forward.check = _check_computable  # type: ignore[attr-defined]
dequant_experts_forward.check = _check_computable  # type: ignore[attr-defined]


class Mxfp4ExpertsInterface(ExpertsInterface):
    """The experts registry of `Mxfp4Experts` (``eager``: its own forward, the reference)."""

    _global_mapping = {
        QUANT_IMPLEMENTATION: quant_experts_forward,
        DEQUANT_IMPLEMENTATION: dequant_experts_forward,
        "grouped_mm": quant_experts_forward,  # what a GPT-OSS config names by default
        "batched_mm": quant_experts_forward,
    }


MXFP4_EXPERTS_FUNCTIONS = Mxfp4ExpertsInterface()


@use_experts_implementation(experts_interface=MXFP4_EXPERTS_FUNCTIONS, has_bias=True)
class Mxfp4Experts(nn.Module):
    """GPT-OSS experts holding their MXFP4 checkpoint tensors (shapes in the module docstring).

    Computes GPT-OSS's clamped SwiGLU on interleaved gate/up rows; ``forward`` (``eager``)
    dequantizes in torch, the other registered names run the Triton kernels.
    """

    def __init__(self, config, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        for name in MXFP4_TENSORS:
            tensor = tensors[name]
            if name.endswith("_blocks"):
                tensor = tensor.reshape(*tensor.shape[:2], -1)  # 3-D, as transformers declares them
            self.register_parameter(name.removesuffix("_blocks"), nn.Parameter(tensor, requires_grad=False))
        shape = tensors["gate_up_proj_scales"].shape  # [E, 2I, G(H)]
        self.num_experts = int(shape[0])
        self.hidden_size = int(config.hidden_size)
        self.intermediate_size = int(shape[1]) // 2
        self.alpha = 1.702
        self.limit = float(getattr(config, "swiglu_limit", 7.0))
        _check_mxfp4_shapes(self)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return dequant_experts_forward(self, hidden_states, top_k_index, top_k_weights)


#: The tensors of one GPT-OSS MXFP4 experts module in a checkpoint (under ``<module>.``).
MXFP4_TENSORS = (
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "gate_up_proj_bias",
    "down_proj_blocks",
    "down_proj_scales",
    "down_proj_bias",
)


def _check_mxfp4_shapes(module: Mxfp4Experts) -> None:
    experts, inter, hidden = module.num_experts, module.intermediate_size, module.hidden_size
    expected = {
        "gate_up_proj": (experts, 2 * inter, mxfp4_groups(hidden) * GROUP // 2),
        "gate_up_proj_scales": (experts, 2 * inter, mxfp4_groups(hidden)),
        "gate_up_proj_bias": (experts, 2 * inter),
        "down_proj": (experts, hidden, mxfp4_groups(inter) * GROUP // 2),
        "down_proj_scales": (experts, hidden, mxfp4_groups(inter)),
        "down_proj_bias": (experts, hidden),
    }
    for name, shape in expected.items():
        tensor = getattr(module, name)
        if tuple(tensor.shape) != shape or (not name.endswith("bias") and tensor.dtype != torch.uint8):
            raise ValueError(f"MXFP4 {name} must be {'' if name.endswith('bias') else 'uint8 '}{list(shape)}, "
                             f"got {tensor.dtype} {list(tensor.shape)}")  # fmt: skip


def load_mxfp4_experts(model: nn.Module, checkpoint: str | os.PathLike | Mapping[str, torch.Tensor]) -> list[str]:
    """Replace every experts module whose MXFP4 tensors the checkpoint holds by an
    `Mxfp4Experts` holding them packed (the module's dequantized weights are dropped).

    For a GPT-OSS checkpoint loaded where transformers dequantizes it (no hub kernels:
    ``from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True))``); then
    `enable_expert_cache` serves the packed bytes.

    Args:
        model: the loaded model.
        checkpoint: its directory (``*.safetensors``; only the expert tensors are read), or
            a mapping of the checkpoint's names to tensors.

    Returns:
        The names of the replaced modules, in model order.

    Raises:
        ValueError: the checkpoint holds MXFP4 tensors for no module of ``model``, or for a
            module that is not GPT-OSS experts of the same number (nothing is replaced then).
    """
    tensors = _mxfp4_tensors(model, checkpoint)
    if not tensors:
        raise ValueError("the checkpoint holds no '<experts>.gate_up_proj_blocks' for any module of this model")
    replacements = {name: _mxfp4_module(name, model.get_submodule(name), parts) for name, parts in tensors.items()}
    for name, module in replacements.items():  # all built: nothing can fail from here
        model.set_submodule(name, module)
    return list(tensors)


def _mxfp4_module(name: str, old: nn.Module, parts: dict[str, torch.Tensor]) -> Mxfp4Experts:
    experts = parts["gate_up_proj_blocks"].shape[0]
    if not getattr(old, "has_bias", False) or getattr(old, "num_experts", None) != experts:
        raise ValueError(f"{name} ({type(old).__name__}) is not a GPT-OSS experts module with the checkpoint's "
                         f"{experts} experts and biases: nothing was replaced")  # fmt: skip
    weight = old.get_parameter("gate_up_proj")
    device = parts["gate_up_proj_blocks"].device if weight.is_meta else weight.device
    return Mxfp4Experts(old.config, {key: value.to(device) for key, value in parts.items()})


def _mxfp4_tensors(model: nn.Module, checkpoint) -> dict[str, dict[str, torch.Tensor]]:
    names = [name for name, _ in model.named_modules()]
    if isinstance(checkpoint, Mapping):
        read = checkpoint.__getitem__
        keys = set(checkpoint)
    else:
        read, keys = _safetensors_reader(checkpoint)
    found = {}
    for name in names:
        if f"{name}.gate_up_proj_blocks" in keys:
            found[name] = {part: read(f"{name}.{part}") for part in MXFP4_TENSORS}
    return found


def _safetensors_reader(directory: str | os.PathLike):
    from safetensors import safe_open

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as file:
            file_of = {key: os.path.join(directory, name) for key, name in json.load(file)["weight_map"].items()}
    else:
        single = os.path.join(directory, "model.safetensors")
        with safe_open(single, framework="pt") as handle:
            file_of = {key: single for key in handle.keys()}  # noqa: SIM118 - safe_open has no __iter__

    def read(key: str) -> torch.Tensor:
        with safe_open(file_of[key], framework="pt") as handle:
            return handle.get_tensor(key)

    return read, set(file_of)


#: `quantize_experts`' FP8 scale block: DeepSeek-V3's and Qwen3-FP8's.
FP8_BLOCK = (128, 128)


def quantize_experts(model: nn.Module, fmt: str, *, block: tuple[int, int] | None = FP8_BLOCK) -> list[str]:
    """Quantize a float model's routed experts in place into a checkpoint's packed format.

    For tests and benchmarks over random weights (a real checkpoint arrives packed). Every
    module is quantized (a few experts at a time) before the model changes, so an error
    leaves it as it was; the peak memory is the float model's plus the packed experts'.

    Args:
        model: a transformers model with float experts (``mlp.experts`` modules).
        fmt: ``"fp8"``: transformers' ``FP8Experts`` (e4m3 values, fp32 ``*_scale_inv``), for
            gated experts without biases (Qwen3-MoE, DeepSeek-V3, ...); ``"mxfp4"``: an
            `Mxfp4Experts` (e2m1 blocks, e8m0 scales per 32 values, biases kept), for GPT-OSS.
        block: FP8 scale block (rows, columns); None: per tensor (gate and up apart, as
            transformers keeps them). MXFP4's groups are fixed (32 values): any other block
            than the default is refused there.

    Returns:
        The names of the replaced modules, in model order.

    Raises:
        ValueError: an unknown format, a bad block, experts the format does not apply to,
            or experts an expert cache serves (nothing is replaced then).
    """
    from expertcache.integrations.transformers.dispatch import is_bound

    experts = {name: module for name, module in model.named_modules() if name.endswith("mlp.experts")}
    if fmt not in ("fp8", "mxfp4"):
        raise ValueError(f"unknown expert format {fmt!r}: expected 'fp8' or 'mxfp4'")
    if fmt == "mxfp4" and block != FP8_BLOCK:
        raise ValueError(f"block applies to fp8 only (MXFP4 scales groups of 32 values), got block={block!r}")
    if block is not None and not (
        isinstance(block, tuple) and len(block) == 2 and all(type(size) is int and size >= 1 for size in block)
    ):
        raise ValueError(f"block must be None (per tensor) or two positive ints (rows, columns), got {block!r}")
    served = [name for name, module in experts.items() if is_bound(module)]
    if served:
        raise ValueError(f"{served[0]} is served by an expert cache: disable() it before quantizing "
                         f"(nothing was replaced)")  # fmt: skip
    if not experts or not all(_quantizable(module, fmt) for module in experts.values()):
        wanted = "GPT-OSS experts (with biases)" if fmt == "mxfp4" else "gated experts without biases"
        raise ValueError(f"{fmt} quantization needs float {wanted}; this model's are not: nothing was replaced")
    if fmt == "mxfp4":
        checkpoint = {}
        for name, module in experts.items():  # GPT-OSS keeps x @ W: [E, H, 2I], [E, I, H]
            for proj in ("gate_up_proj", "down_proj"):
                blocks, scales = _chunked(quantize_mxfp4, module.get_parameter(proj).detach().transpose(1, 2))
                checkpoint[f"{name}.{proj}_blocks"], checkpoint[f"{name}.{proj}_scales"] = blocks, scales
                checkpoint[f"{name}.{proj}_bias"] = module.get_parameter(f"{proj}_bias").detach()
        return load_mxfp4_experts(model, checkpoint)
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    packed = {}  # every module quantized before the model changes: an error leaves it as it was
    for name, module in experts.items():
        for proj in ("gate_up_proj", "down_proj"):
            weight = module.get_parameter(proj).detach()
            rows, cols = weight.shape[-2:]
            tile = block or ((rows // 2, cols) if proj == "gate_up_proj" else (rows, cols))
            packed[name, proj] = _chunked(lambda w, tile=tile: quantize_fp8_blocks(w, tile), weight)
    experts.clear()
    config = FineGrainedFP8Config(weight_block_size=block)
    replace_with_fp8_linear(model, modules_to_not_convert=[r"(?!.*\.experts$).*"], quantization_config=config,
                            pre_quantized=True)  # meta modules: only the experts become FP8  # fmt: skip
    for (name, proj), (values, scales) in packed.items():
        module = model.get_submodule(name)
        setattr(module, proj, nn.Parameter(values, requires_grad=False))
        setattr(module, f"{proj}_scale_inv", nn.Parameter(scales, requires_grad=False))
    return [name for name, _ in model.named_modules() if name.endswith("mlp.experts")]


def _chunked(quantize, weight: torch.Tensor, experts_at_once: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [quantize(weight[start : start + experts_at_once]) for start in range(0, weight.shape[0], experts_at_once)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _quantizable(module: nn.Module, fmt: str) -> bool:
    if not isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) or is_quantized(module):
        return False
    return bool(getattr(module, "has_bias", False)) == (fmt == "mxfp4")


def register() -> None:
    """Add the two compute implementations to transformers' FP8 experts registry (where this
    transformers has one), so ``set_experts_implementation`` accepts their names; and both to
    the float registry (format "none"; the kernels are bit-identical over passes, see dispatch)."""
    ExpertsInterface.register(QUANT_IMPLEMENTATION, quant_experts_forward)
    ExpertsInterface.register(DEQUANT_IMPLEMENTATION, dequant_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        return
    FP8ExpertsInterface.register(QUANT_IMPLEMENTATION, quant_experts_forward)
    FP8ExpertsInterface.register(DEQUANT_IMPLEMENTATION, dequant_experts_forward)


register()
