"""Quantized expert blocks of transformers models: what they compute with, and MXFP4 loading.

The cache serves packed experts as they are (any dtype per tensor, never dequantized in the
store or the slots); this module supplies what computes on them where transformers cannot:

    FP8Experts (transformers' finegrained FP8, Qwen3-FP8 / DeepSeek-V3 checkpoints)
      gate_up_proj           [E, 2I, H] float8_e4m3fn    gate_up_proj_scale_inv [E, 2I/bn, H/bk] fp32
      down_proj              [E, H, I]  float8_e4m3fn    down_proj_scale_inv    [E, H/bn, I/bk]  fp32
      (``block_size=None``, per-tensor: ``[E, 2, 1]`` (gate and up apart) and ``[E, 1, 1]``)
    `packed_models.Mxfp4Experts` (GPT-OSS MXFP4; the checkpoint's layout, 3-D like transformers')
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
                           own FP8 functions run once per pass, summed in fp32: close, not equal)
    "expertcache_dequant"  pure torch: dequantize the experts referenced, run the float MLP
                           (the dequantization transformers applies when it loads a
                           checkpoint with ``dequantize=True``)

transformers' MXFP4 GPT-OSS experts (``Mxfp4GptOssExperts``) run only through the hub's
``gpt-oss-triton-kernels`` on swizzled tensors and are not dispatched through an experts
registry; without those kernels transformers dequantizes the checkpoint to bf16. To serve
the packed bytes instead, `packed_models.load_mxfp4_experts` replaces each GPT-OSS experts
module by an `packed_models.Mxfp4Experts` holding the checkpoint's blocks and scales; it
dispatches through `MXFP4_EXPERTS_FUNCTIONS`, where ``eager`` is the reference and every
other name the kernels. (`packed_models.quantize_experts` makes FP8 or MXFP4 experts from
float ones.)

This module holds those experts functions and their registration (importing it registers
them); the tensors they compute on, under `expertcache.quant`'s names, come from
`packed_tensors.packed_operands` (re-exported here with `is_quantized`, `fp8_block_of` and
`on_block_grid`).
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ExpertsInterface

from expertcache.integrations.transformers.packed_tensors import (
    fp8_block_of,
    is_quantized,
    on_block_grid,
    packed_operands,
)
from expertcache.integrations.transformers.pass_runs import PassSummer
from expertcache.quant_checks import check_router_call
from expertcache.quant_fp8 import dequantize_fp8_blocks
from expertcache.quant_mxfp4 import dequantize_mxfp4
from expertcache.reference import gated_moe_forward
from expertcache.result import ExpertWeightResult

__all__ = [
    "DEQUANT_IMPLEMENTATION",
    "MXFP4_EXPERTS_FUNCTIONS",
    "QUANT_IMPLEMENTATION",
    "Mxfp4ExpertsInterface",
    "dequant_experts_forward",
    "fp8_block_of",
    "is_quantized",
    "on_block_grid",
    "packed_operands",
    "quant_experts_forward",
    "quant_experts_passes",
    "register",
]

QUANT_IMPLEMENTATION = "expertcache_quant"
DEQUANT_IMPLEMENTATION = "expertcache_dequant"


def dequant_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """Experts function: dequantize the experts ``top_k_index`` refers to and run the float
    MLP in fp32 (the pure-torch reference).

    Args:
        hidden_states: ``[T, H]``; top_k_index: ``[T, K]`` ids into the module's ``[N, ...]``
            tensors (others, -1 or transformers' expert-parallel sentinel ``N``, contribute
            nothing, as in the kernels); top_k_weights: ``[T, K]``.

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype.
    """
    tensors, scheme = packed_operands(self)
    check_router_call(hidden_states, top_k_weights, top_k_index)
    num_experts = tensors["w1"].shape[0]
    served = (top_k_index >= 0) & (top_k_index < num_experts)  # others (-1, the EP sentinel): nothing, as the kernels
    used, local = torch.unique(torch.where(served, top_k_index, num_experts), return_inverse=True)
    local = torch.where(served, local, -1)
    picked = {name: tensor.index_select(0, used.clamp(max=num_experts - 1)) for name, tensor in tensors.items()}
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
