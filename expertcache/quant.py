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

`expertcache.reference.gated_moe_forward` is that MLP in float (the reference),
`quant_moe_forward` beside it dequantises first. `expertcache.quant_tensors` turns float
``[E, 2I, H]`` / ``[E, H, I]`` weights into a scheme's tensors (`quantize_experts`) and back
(`dequantize_experts`); `expertcache.quant_checks` holds the input checks they share. Format
``"none"`` lets one kernel serve a model in both its quantised and its 16-bit form (GPT-OSS's
MXFP4 and bf16 checkpoints).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch

from expertcache.quant_fp8 import check_fp8_block
from expertcache.validation import check_flag

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
