"""Expert weight schemes: the tensors one expert registers, and the MLP they compute.

A `QuantScheme` names a storage format (quantised, or plain 16/32-bit) and the expert MLP
around it; the cache stores the tensors as opaque per-expert bytes (`expertcache.layout`)
and the apply kernels (`expertcache.kernels.quant_apply`, ``quant_grouped``) dequantise in
registers. Registered names, with ``G(K) = ceil(K/32)``::

    scheme           w1 (per expert)     w2 (per expert)     w1_scale, w2_scale                          extra
    FP8_BLOCK_128    [2I, H] e4m3        [H, I] e4m3         [ceil(2I/128), ceil(H/128)] fp32,           -
                                                             [ceil(H/128), ceil(I/128)] fp32
    FP8_PER_TENSOR   [2I, H] e4m3        [H, I] e4m3         [] fp32, [] fp32 (one per expert)           -
    GPT_OSS_MXFP4    [2I, G(H), 16] u8   [H, G(I), 16] u8    [2I, G(H)] e8m0 u8, [H, G(I)] e8m0 u8      w1_bias [2I],
                                                                                                       w2_bias [H] fp32
    GPT_OSS_BF16     [2I, H] bf16        [H, I] bf16         -                                           as MXFP4
    format "none"    [2I, H], [H, I] bf16, fp16 or fp32 (`unquantized` of any scheme: its MLP, no scales)

(shapes per expert; `expertcache.quant_fp8`, `expertcache.quant_mxfp4` define the formats).
The MLP of every (token t, choice k) with expert e, dequantised weights ``W1``, ``W2``::

    h      = x_t @ W1[e].T (+ w1_bias[e])               [2I]
    gate, up = h[:I], h[I:]   (gate_up="concatenated": Qwen3, DeepSeek, Mixtral)
             | h[0::2], h[1::2]  (gate_up="interleaved": GPT-OSS)
    a      = silu(gate) * up                            (activation="silu")
           | (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
                                                        (activation="swiglu_oai": GPT-OSS)
    y_tk   = a @ W2[e].T (+ w2_bias[e])                 [H]
    out_t  = sum over k of topk_weights[t, k] * y_tk, in k order; ids -1 contribute nothing

`gated_moe_forward` is that MLP in float (the reference), `quant_moe_forward` dequantises
first. `quantize_experts` turns float ``[E, 2I, H]`` / ``[E, H, I]`` weights into a
scheme's tensors, `dequantize_experts` back. Format ``"none"`` lets one kernel serve a model
in both its quantised and its 16-bit form (GPT-OSS's MXFP4 and bf16 checkpoints).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from expertcache.quant_fp8 import (
    check_fp8_block,
    dequantize_fp8_blocks,
    dequantize_fp8_per_tensor,
    quantize_fp8_blocks,
    quantize_fp8_per_tensor,
)
from expertcache.quant_mxfp4 import dequantize_mxfp4, quantize_mxfp4
from expertcache.reference import combine_expert_outputs
from expertcache.result import ExpertWeightResult
from expertcache.validation import check_flag, check_int

FORMATS = ("fp8", "mxfp4", "none")
#: weight dtypes of format "none"
UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GATE_UP_LAYOUTS = ("concatenated", "interleaved")
ACTIVATIONS = ("silu", "swiglu_oai")


#: GPT-OSS's clamped SwiGLU constants: ``gate * sigmoid(alpha * gate)``, both clamped at ``limit``.
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """A storage format and the gated expert MLP around it (see the module docstring).

    Attributes:
        format: ``"fp8"`` (e4m3 with fp32 scales), ``"mxfp4"`` (e2m1 with e8m0 scales) or
            ``"none"`` (bf16, fp16 or fp32 weights as they are, no scales).
        fp8_block: fp8 only: ``(rows, columns)`` per scale, or None for one scale per
            expert matrix (per-tensor).
        gate_up: which rows of ``w1`` are the gate: ``"concatenated"`` (the first I) or
            ``"interleaved"`` (the even ones).
        activation: ``"silu"`` (SwiGLU) or ``"swiglu_oai"`` (GPT-OSS's clamped SwiGLU).
        alpha, limit: the constants of ``"swiglu_oai"``.
        has_bias: ``w1_bias`` ``[E, 2I]`` and ``w2_bias`` ``[E, H]`` are registered and added.
    """

    format: str
    fp8_block: tuple[int, int] | None = None
    gate_up: str = "concatenated"
    activation: str = "silu"
    alpha: float = SWIGLU_OAI_ALPHA
    limit: float = SWIGLU_OAI_LIMIT
    has_bias: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.gate_up not in GATE_UP_LAYOUTS:
            raise ValueError(f"gate_up must be one of {GATE_UP_LAYOUTS}, got {self.gate_up!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.fp8_block is not None:
            if self.format != "fp8":
                raise ValueError(f"fp8_block is for format 'fp8' only (None otherwise); got {self.fp8_block!r}")
            # a list is the tuple it holds (equal and hashable as the scheme's field says)
            object.__setattr__(self, "fp8_block", check_fp8_block(self.fp8_block, "fp8_block"))
        check_flag("has_bias", self.has_bias)
        self._check_constants()

    def _check_constants(self) -> None:
        """``alpha`` and ``limit``: positive finite numbers, given only for ``"swiglu_oai"``
        (``"silu"`` has no constants: another value there would be ignored)."""
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r:.40}")
            if not (math.isfinite(value) and float(value) > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.activation == "silu" and (self.alpha, self.limit) != (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT):
            raise ValueError(
                f"alpha and limit are activation 'swiglu_oai''s constants; 'silu' has none "
                f"(got alpha={self.alpha!r}, limit={self.limit!r})"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """The registered tensor names, ``w1`` and ``w2`` first (no scales for format ``"none"``)."""
        scales = () if self.format == "none" else ("w1_scale", "w2_scale")
        return ("w1", "w2", *scales) + (("w1_bias", "w2_bias") if self.has_bias else ())


def unquantized(scheme: QuantScheme) -> QuantScheme:
    """``scheme``'s MLP (gate/up layout, activation, biases) on 16/32-bit weights: format ``"none"``."""
    return replace(scheme, format="none", fp8_block=None)


#: DeepSeek-V3 / Qwen3-FP8: e4m3, 128x128 block scales, SwiGLU.
FP8_BLOCK_128 = QuantScheme("fp8", fp8_block=(128, 128))
#: e4m3, one scale per expert matrix, SwiGLU.
FP8_PER_TENSOR = QuantScheme("fp8")
#: GPT-OSS: MXFP4, interleaved gate/up, clamped SwiGLU, biases.
GPT_OSS_MXFP4 = QuantScheme("mxfp4", gate_up="interleaved", activation="swiglu_oai", has_bias=True)
#: GPT-OSS's MLP on unquantised weights (bf16 checkpoints, or MXFP4 dequantised; fp16/fp32 work too).
GPT_OSS_BF16 = unquantized(GPT_OSS_MXFP4)


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
        ``{name: [E, ...]}`` in ``scheme.names`` order (shapes in the module docstring).
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


def gated_moe_forward(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    scheme: QuantScheme,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated expert MLP of ``scheme`` on float weights, the slow and obvious way.

    Args:
        hidden: ``[T, H]`` float tokens.
        w1: ``[N, 2I, H]``, w2: ``[N, H, I]`` float weights indexed by ``topk_ids``.
        topk_weights: ``[T, K]``; topk_ids: ``[T, K]`` ints, -1 contributes nothing.
        scheme: gate/up layout, activation, whether biases are added.
        w1_bias, w2_bias: ``[N, 2I]``, ``[N, H]`` when ``scheme.has_bias``.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype, summed over k in k order; ids outside ``[0, N)``
        contribute nothing.
    """
    check_scheme(scheme)
    check_router_call(hidden, topk_weights, topk_ids)
    _check_float_experts(w1, w2, finite=False, hidden_size=hidden.shape[1])
    _check_biases(scheme, w1, w2, w1_bias, w2_bias)
    tokens, top_k = topk_ids.shape
    per_choice = hidden.new_zeros(tokens, top_k, w2.shape[1])  # y_tk, [T, K, H]
    for expert in torch.unique(topk_ids).tolist():
        if not 0 <= expert < w1.shape[0]:  # -1 and other ids outside the experts: nothing
            continue
        token_idx, choice_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        h = hidden[token_idx] @ w1[expert].T.to(hidden.dtype)
        if scheme.has_bias:
            h = h + w1_bias[expert].to(h.dtype)  # type: ignore[index]
        y = _activate(h, scheme) @ w2[expert].T.to(hidden.dtype)
        if scheme.has_bias:
            y = y + w2_bias[expert].to(y.dtype)  # type: ignore[index]
        per_choice[token_idx, choice_idx] = y
    return combine_expert_outputs(per_choice, topk_weights)


def quant_moe_forward(
    hidden: torch.Tensor,
    weights: Mapping[str, torch.Tensor] | ExpertWeightResult,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    scheme: QuantScheme,
) -> torch.Tensor:
    """`gated_moe_forward` in float32 on the dequantised tensors of ``scheme`` (``[N, ...]``).

    Ids outside ``[0, N)`` contribute nothing, as in the kernels. Returns ``[T, H]`` float32.
    """
    check_scheme(scheme)
    tensors = weights_of(weights)
    check_unregistered(scheme, tensors)
    check_router_call(hidden, topk_weights, topk_ids)
    w1, w2 = dequantize_experts(scheme, tensors, hidden.shape[1])
    ids = torch.where((topk_ids >= 0) & (topk_ids < w1.shape[0]), topk_ids, -1)
    return gated_moe_forward(hidden.float(), w1, w2, topk_weights.float(), ids, scheme=scheme,
                             w1_bias=tensors.get("w1_bias"), w2_bias=tensors.get("w2_bias"))  # fmt: skip


def _activate(h: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    if scheme.gate_up == "interleaved":
        gate, up = h[..., 0::2], h[..., 1::2]
    else:
        gate, up = h.chunk(2, dim=-1)
    if scheme.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=scheme.limit)
    up = up.clamp(min=-scheme.limit, max=scheme.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * scheme.alpha))


def check_scheme(scheme: object) -> QuantScheme:
    """``scheme`` is a `QuantScheme` (a format name alone says nothing of the MLP)."""
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"scheme must be a QuantScheme (e.g. FP8_BLOCK_128), got {type(scheme).__name__}")
    return scheme


def check_unregistered(scheme: QuantScheme, tensors: Mapping[str, torch.Tensor | None]) -> None:
    """Scales or biases that ``scheme`` does not register would be dropped: refused."""
    for name in ("w1_scale", "w2_scale", "w1_bias", "w2_bias"):
        if tensors.get(name) is not None and name not in scheme.names:
            why = "has_bias=False" if name.endswith("_bias") else "format 'none' has no scales"
            raise ValueError(f"{name} given but the scheme registers {list(scheme.names)} ({why}): it would be dropped")


def check_router_call(hidden: object, topk_weights: object, topk_ids: object) -> None:
    """``hidden`` ``[T, H]`` floating point, ``topk_weights`` floating point and ``topk_ids``
    int32/int64, both ``[T, K]``, on ``hidden``'s device."""
    for name, tensor in (("hidden", hidden), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    assert isinstance(hidden, torch.Tensor) and isinstance(topk_weights, torch.Tensor)
    assert isinstance(topk_ids, torch.Tensor)
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be floating point [T, H], got {hidden.dtype} {list(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights and topk_ids must both be [T, K] with T = {hidden.shape[0]}, got "
                         f"{list(topk_weights.shape)} and {list(topk_ids.shape)}")  # fmt: skip
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise TypeError(f"topk_ids must be int32/int64 and topk_weights floating point, got {topk_ids.dtype}, "
                        f"{topk_weights.dtype}")  # fmt: skip
    for name, tensor in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device}, hidden on {hidden.device}")


def _check_float_tensor(name: str, tensor: object, device: torch.device | None = None) -> None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{name} must be a floating-point tensor, got {got}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, w1 on {device}")


def _check_float_experts(w1: object, w2: object, *, finite: bool, hidden_size: int | None = None) -> None:
    """Float ``w1`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` that agree (``H = hidden_size`` when
    given); ``finite``: no inf or NaN (a quantised block's scale would be inf or NaN)."""
    _check_float_tensor("w1", w1)
    assert isinstance(w1, torch.Tensor)
    _check_float_tensor("w2", w2, w1.device)
    assert isinstance(w2, torch.Tensor)
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1 and w2 must be 3-D [E, 2I, H] and [E, H, I], got {list(w1.shape)} and {list(w2.shape)}")
    num, rows, hidden = w1.shape
    if w2.shape[0] != num or w2.shape[1] != hidden or rows != 2 * w2.shape[2] or rows == 0 or hidden == 0:
        raise ValueError(f"w1 [E, 2I, H] and w2 [E, H, I] disagree: got {list(w1.shape)} and {list(w2.shape)}")
    if hidden_size is not None and hidden != hidden_size:
        raise ValueError(f"hidden has {hidden_size} columns but the experts' H is {hidden} (w1 {list(w1.shape)})")
    for name, weight in (("w1", w1), ("w2", w2)):
        if finite and not bool(torch.isfinite(weight).all()):
            raise ValueError(f"{name} must be finite to be quantised (an inf or NaN spoils its block's scale)")


def _check_biases(scheme: QuantScheme, w1: torch.Tensor, w2: torch.Tensor, w1_bias, w2_bias) -> None:
    """``w1_bias`` ``[N, 2I]`` and ``w2_bias`` ``[N, H]`` exactly when ``scheme.has_bias``."""
    if not scheme.has_bias:
        if w1_bias is not None or w2_bias is not None:
            raise ValueError("w1_bias / w2_bias given but the scheme has has_bias=False: they would be dropped")
        return
    for name, bias, rows in (("w1_bias", w1_bias, w1.shape[:2]), ("w2_bias", w2_bias, w2.shape[:2])):
        if bias is None:
            raise ValueError(f"{name} is required: the scheme has has_bias=True")
        _check_float_tensor(name, bias, w1.device)
        if tuple(bias.shape) != tuple(rows):
            raise ValueError(f"{name} must be {list(rows)}, got {list(bias.shape)}")
