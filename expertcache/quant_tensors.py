"""A scheme's registered tensors: made from float weights, turned back, read from a result.

`quantize_experts` turns float ``[E, 2I, H]`` / ``[E, H, I]`` weights into the tensors a
`expertcache.quant.QuantScheme` registers (names and shapes in `expertcache.quant`),
`dequantize_experts` turns them back into float32; `weights_of` reads them from a mapping or
from a provider's `ExpertWeightResult` (what the apply kernels and
`expertcache.reference.quant_moe_forward` accept). The formats themselves are
`expertcache.quant_fp8` and `expertcache.quant_mxfp4`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from expertcache.quant import UNQUANTIZED_DTYPES, QuantScheme
from expertcache.quant_checks import _check_float_experts, _check_float_tensor, check_scheme
from expertcache.quant_fp8 import (
    dequantize_fp8_blocks,
    dequantize_fp8_per_tensor,
    quantize_fp8_blocks,
    quantize_fp8_per_tensor,
)
from expertcache.quant_mxfp4 import dequantize_mxfp4, quantize_mxfp4
from expertcache.result import ExpertWeightResult
from expertcache.validation import check_int


def quantize_experts(
    scheme: QuantScheme,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The registered tensors of ``scheme`` from float weights.

    Args:
        w1: ``[E, 2I, H]`` float, rows in ``scheme.gate_up`` order.
        w2: ``[E, H, I]`` float.
        w1_bias, w2_bias: ``[E, 2I]``, ``[E, H]``, required when ``scheme.has_bias`` (kept fp32).
        dtype: format ``"none"`` only: the weights' dtype (bf16, fp16 or fp32; default: ``w1``'s).

    Returns:
        ``{name: [E, ...]}`` in ``scheme.names`` order (shapes in `expertcache.quant`'s docstring).
    """
    check_scheme(scheme)
    _check_float_experts(w1, w2, finite=scheme.format != "none")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (bf16, fp16 or fp32) or None, got {dtype!r:.40}")
    if dtype is not None and scheme.format != "none":
        raise ValueError(f"dtype is for format 'none' only; {scheme.format} has its own")
    out = {}
    for name, weight in (("w1", w1), ("w2", w2)):
        if scheme.format == "none":
            out[name] = weight.to(dtype or w1.dtype).contiguous()
            if out[name].dtype not in UNQUANTIZED_DTYPES:
                raise ValueError(f"format 'none' stores {UNQUANTIZED_DTYPES}, got {out[name].dtype}")
        elif scheme.format == "mxfp4":
            out[name], out[f"{name}_scale"] = quantize_mxfp4(weight)
        elif scheme.fp8_block is None:
            out[name], out[f"{name}_scale"] = quantize_fp8_per_tensor(weight)
        else:
            out[name], out[f"{name}_scale"] = quantize_fp8_blocks(weight, scheme.fp8_block)
    if not scheme.has_bias and (w1_bias is not None or w2_bias is not None):
        raise ValueError("this scheme registers no biases (has_bias=False): they would be dropped; give none")
    if scheme.has_bias:
        if w1_bias is None or w2_bias is None:
            raise ValueError("this scheme registers biases: give w1_bias [E, 2I] and w2_bias [E, H]")
        for name, bias, rows in (("w1_bias", w1_bias, w1.shape[:2]), ("w2_bias", w2_bias, w2.shape[:2])):
            _check_float_tensor(name, bias, w1.device)
            if tuple(bias.shape) != tuple(rows):
                raise ValueError(f"{name} must be {list(rows)} (a row per expert and output), got {list(bias.shape)}")
            out[name] = bias.float().contiguous()
    return {name: out[name] for name in scheme.names}


def dequantize_experts(
    scheme: QuantScheme, weights: Mapping[str, torch.Tensor] | ExpertWeightResult, hidden_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w1 [N, 2I, H], w2 [N, H, I])`` float32 from a scheme's tensors (``N`` experts or slots).

    ``hidden_size`` (H) is needed because MXFP4 pads the columns to whole groups of 32.
    """
    check_scheme(scheme)
    tensors = weights_of(weights)
    missing = [name for name in scheme.names if not name.endswith("_bias") and tensors.get(name) is None]
    if missing:
        raise ValueError(f"weights lack {missing}; scheme {scheme.format} registers {list(scheme.names)}")
    hidden_size = check_int("hidden_size", hidden_size, minimum=1, expected="a positive int (H)")
    if scheme.format != "mxfp4" and tensors["w1"].shape[-1] != hidden_size:  # MXFP4: dequantize_mxfp4 checks
        raise ValueError(f"hidden_size must be the weights' H, {tensors['w1'].shape[-1]}; got {hidden_size}")
    if scheme.format == "none":
        for name in ("w1", "w2"):
            if tensors[name].dtype not in UNQUANTIZED_DTYPES:
                raise ValueError(f"format 'none' stores {UNQUANTIZED_DTYPES}; {name} is {tensors[name].dtype}")
        return tensors["w1"].float(), tensors["w2"].float()
    w1, w2, s1, s2 = (tensors[name] for name in ("w1", "w2", "w1_scale", "w2_scale"))
    if scheme.format == "mxfp4":
        inter = w1.shape[1] // 2
        return dequantize_mxfp4(w1, s1, hidden_size), dequantize_mxfp4(w2, s2, inter)
    if scheme.fp8_block is None:
        return dequantize_fp8_per_tensor(w1, s1), dequantize_fp8_per_tensor(w2, s2)
    return dequantize_fp8_blocks(w1, s1, scheme.fp8_block), dequantize_fp8_blocks(w2, s2, scheme.fp8_block)


def weights_of(weights: Mapping[str, torch.Tensor] | ExpertWeightResult) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of a mapping, or of a provider's result (its fields and ``extra``)."""
    if isinstance(weights, ExpertWeightResult):
        named = {"w1": weights.w1, "w2": weights.w2, "w1_scale": weights.w1_scale, "w2_scale": weights.w2_scale}
        return {**{k: v for k, v in named.items() if v is not None}, **weights.extra}
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must map names to tensors or be an ExpertWeightResult, got {type(weights).__name__}")
    return dict(weights)
