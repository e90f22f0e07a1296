"""What the quantised apply kernels share: in-register decoding, the activations, and checks.

Decoding never leaves registers: an fp8 weight is loaded as e4m3 and converted; an MXFP4
byte is split into its two e2m1 nibbles arithmetically (`e2m1_to_float`; the GEMV places the
bits in a float16, `e2m1_pair_to_float`) and its group's
e8m0 code becomes ``2 ** (code - 127)`` by placing it in a float32 exponent (`e8m0_to_float`,
code 0 -> 0); an unquantised (format ``"none"``) weight is loaded as it is and never scaled,
the fp8 code path without its scale. `QuantOperands` is the validated view of one call's
tensors that both the GEMV (`quant_apply`) and grouped (`quant_grouped`) launchers pass on,
one `Projection` per weight matrix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import runs_on
from expertcache.quant import UNQUANTIZED_DTYPES, QuantScheme
from expertcache.quant_checks import check_router_call, check_scheme, check_unregistered
from expertcache.quant_mxfp4 import GROUP, mxfp4_groups

FORMAT_FP8, FORMAT_MXFP4, FORMAT_NONE = 0, 1, 2
FORMAT_CODES = {"fp8": FORMAT_FP8, "mxfp4": FORMAT_MXFP4, "none": FORMAT_NONE}
ACTIVATION_SILU, ACTIVATION_SWIGLU_OAI = 0, 1
#: dtypes of the tokens (``hidden``) an apply takes
TOKEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def e2m1_to_float(nibbles):
    """float32 value of e2m1 codes (0-15, any integer dtype)."""
    code = nibbles.to(tl.int32)
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    # exponent 0: 0 or 0.5; else (1 + mantissa / 2) * 2 ** (exponent - 1)
    value = tl.where(exponent == 0, 0.5 * mantissa, (2.0 + mantissa) * (1 << exponent).to(tl.float32) * 0.25)
    return tl.where((code & 8) != 0, -value, value)


#: `e2m1_pair_to_float` returns values divided by this (2 ** 14): multiply a sum of its products by it
E2M1_PAIR_UNSCALE = tl.constexpr(16384.0)


@triton.jit
def e2m1_pair_to_float(packed):
    """float32 ``(low, high)`` nibble values of MXFP4 bytes, each divided by 2 ** 14.

    The nibble's three value bits go straight into a float16's exponent and leading mantissa
    bits (sign to sign): ``s e1 e0 m`` is ``2**(e - 15) * (1 + m/2)`` there, or ``m * 2**-15``
    for ``e = 0``, i.e. the e2m1 value times 2**-14, exactly. Five integer operations and a
    conversion a nibble, against `e2m1_to_float`'s selects: the GEMV's decode is its cost.
    """
    code = packed.to(tl.int32)
    low = (((code & 0x8) << 12) | ((code & 0x7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
    high = (((code & 0x80) << 8) | ((code & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
    return low.to(tl.float32), high.to(tl.float32)


@triton.jit
def e8m0_to_float(codes):
    """float32 ``2 ** (code - 127)`` of e8m0 codes 1-254 (0 -> 0)."""
    return (codes.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def activate(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """silu(gate) * up, or GPT-OSS's clamped SwiGLU; fp32 in, fp32 out (0, 0 -> 0)."""
    if ACTIVATION == 1:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up
    return act


@dataclass(frozen=True)
class Projection:
    """One weight matrix of every expert (or slot), ``[N, rows, columns]`` after decoding.

    Attributes:
        weight: fp8 or 16/32-bit ``[N, rows, columns]``, or MXFP4 blocks ``[N, rows, G, 16]``.
        scale: fp8 ``[N, ceil(rows/scale_rows), ceil(columns/scale_cols)]`` (a per-tensor
            ``[N]`` is given as its ``[N, 1, 1]`` view) or e8m0 ``[N, rows, G]``; format
            ``"none"``: ``weight`` again, an unused pointer.
        bias: ``[N, rows]`` or None.
        columns: the reduction length (H for w1, I for w2).
        scale_rows, scale_cols: fp8 rows and columns per scale (1 for MXFP4; format ``"none"``:
            rows and columns, one "scale column", so any K step fits).
    """

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    columns: int
    scale_rows: int
    scale_cols: int

    def args(self) -> tuple:
        """Pointer and stride arguments, in the order the kernels take them."""
        bias = self.bias if self.bias is not None else self.scale  # an unused pointer
        return (self.weight, self.scale, bias, self.weight.stride(0), self.weight.stride(1), self.scale.stride(0),
                self.scale.stride(1), bias.stride(0), self.scale_rows, self.scale_cols)  # fmt: skip


@dataclass(frozen=True)
class QuantOperands:
    """The checked tensors of one call: ``w1`` ``[N, 2I, H]``, ``w2`` ``[N, H, I]`` decoded."""

    w1: Projection
    w2: Projection
    num_rows: int
    hidden_size: int
    inter_size: int
    format: int
    activation: int
    has_bias: bool
    row_step: int  # gate row of output i is i * row_step, its up row that + up_offset
    up_offset: int
    alpha: float
    limit: float


def reduction_block(projection: Projection, format: int, limit: int) -> int:
    """Columns per K step: a power of two (at most ``limit``) inside one fp8 scale column,
    or whole MXFP4 groups (32 each)."""
    if format == FORMAT_MXFP4:
        return max(GROUP, min(limit, GROUP * triton.next_power_of_2(mxfp4_groups(projection.columns))))
    if projection.scale_cols >= projection.columns:  # one scale column: any step
        return min(limit, max(16, triton.next_power_of_2(projection.columns)))
    return min(limit, projection.scale_cols & -projection.scale_cols)  # largest power of two dividing it


def quant_operands(
    hidden: torch.Tensor, tensors: Mapping[str, torch.Tensor], topk_weights, topk_ids, scheme: QuantScheme
) -> QuantOperands:
    """Validate one call's inputs against ``scheme`` (see `expertcache.quant`)."""
    check_scheme(scheme)
    missing = [name for name in scheme.names if tensors.get(name) is None]
    if missing:
        raise ValueError(f"weights lack {missing}; scheme {scheme} registers {list(scheme.names)}")
    check_unregistered(scheme, tensors)
    _check_call(hidden, topk_weights, topk_ids)
    for name in scheme.names:
        if tensors[name].device != hidden.device:
            raise ValueError(f"{name} is on {tensors[name].device}, hidden on {hidden.device}")
    hidden_size = hidden.shape[1]
    w1, w2 = tensors["w1"], tensors["w2"]
    if w2.dim() == 3 and w2.shape[1] != hidden_size:  # w2's rows are H in every format (packing is along I)
        raise ValueError(f"hidden has {hidden_size} columns but the experts' H is {w2.shape[1]} (w2 {list(w2.shape)})")
    num_rows = w1.shape[0]
    if scheme.format == "mxfp4":
        inter_size = w1.shape[1] // 2
        projections = (_mxfp4(tensors, "w1", num_rows, 2 * inter_size, hidden_size),
                       _mxfp4(tensors, "w2", num_rows, hidden_size, inter_size))  # fmt: skip
    elif scheme.format == "none":
        inter_size = w1.shape[1] // 2 if w1.dim() == 3 else 0
        projections = (_unquantized(tensors, "w1", num_rows, 2 * inter_size, hidden_size),
                       _unquantized(tensors, "w2", num_rows, hidden_size, inter_size))  # fmt: skip
    else:
        inter_size = w1.shape[1] // 2 if w1.dim() == 3 else 0
        projections = (_fp8(tensors, "w1", num_rows, 2 * inter_size, hidden_size, scheme.fp8_block),
                       _fp8(tensors, "w2", num_rows, hidden_size, inter_size, scheme.fp8_block))  # fmt: skip
    if w1.shape[1] != 2 * inter_size or inter_size < 1:
        raise ValueError(f"w1 must have 2I rows (I >= 1), got {list(w1.shape)}")
    if scheme.has_bias:
        for name, rows in (("w1_bias", 2 * inter_size), ("w2_bias", hidden_size)):
            bias = tensors[name]
            if tuple(bias.shape) != (num_rows, rows) or not bias.is_floating_point() or bias.stride(1) != 1:
                raise ValueError(f"{name} must be floating point [{num_rows}, {rows}], contiguous rows; "
                                 f"got {bias.dtype} {list(bias.shape)}")  # fmt: skip
    interleaved = scheme.gate_up == "interleaved"
    return QuantOperands(
        *projections, num_rows, hidden_size, inter_size,
        format=FORMAT_CODES[scheme.format],
        activation=ACTIVATION_SWIGLU_OAI if scheme.activation == "swiglu_oai" else ACTIVATION_SILU,
        has_bias=scheme.has_bias, row_step=2 if interleaved else 1, up_offset=1 if interleaved else inter_size,
        alpha=float(scheme.alpha), limit=float(scheme.limit),
    )  # fmt: skip


def _fp8(tensors, name, num_rows, rows, columns, block) -> Projection:
    weight, scale = tensors[name], tensors[f"{name}_scale"]
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (num_rows, rows, columns):
        raise ValueError(f"{name} must be float8_e4m3fn [{num_rows}, {rows}, {columns}], "
                         f"got {weight.dtype} {list(weight.shape)}")  # fmt: skip
    if weight.stride(2) != 1:
        raise ValueError(f"the last dimension of {name} must be contiguous")
    scale_rows, scale_cols = (rows, columns) if block is None else block
    grid = (num_rows,) if block is None else (num_rows, -(-rows // scale_rows), -(-columns // scale_cols))
    if tuple(scale.shape) != grid or not scale.is_floating_point():
        raise ValueError(f"{name}_scale must be floating point {list(grid)}, got {scale.dtype} {list(scale.shape)}")
    if block is None:
        scale = scale.view(num_rows, 1, 1)
    elif scale.stride(2) != 1:
        raise ValueError(f"the last dimension of {name}_scale must be contiguous")
    bias = tensors.get(f"{name}_bias")
    return Projection(weight, scale, bias, columns, scale_rows, scale_cols)


def _unquantized(tensors, name, num_rows, rows, columns) -> Projection:
    weight = tensors[name]
    if weight.dtype not in UNQUANTIZED_DTYPES or tuple(weight.shape) != (num_rows, rows, columns):
        raise ValueError(f"{name} must be bf16, fp16 or fp32 [{num_rows}, {rows}, {columns}], "
                         f"got {weight.dtype} {list(weight.shape)}")  # fmt: skip
    if weight.stride(2) != 1:
        raise ValueError(f"the last dimension of {name} must be contiguous")
    return Projection(weight, weight, tensors.get(f"{name}_bias"), columns, rows, columns)


def _mxfp4(tensors, name, num_rows, rows, columns) -> Projection:
    weight, scale = tensors[name], tensors[f"{name}_scale"]
    groups = mxfp4_groups(columns)
    if weight.dtype != torch.uint8 or tuple(weight.shape) != (num_rows, rows, groups, GROUP // 2):
        raise ValueError(f"{name} must be uint8 MXFP4 blocks [{num_rows}, {rows}, {groups}, 16], "
                         f"got {weight.dtype} {list(weight.shape)}")  # fmt: skip
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (num_rows, rows, groups):
        raise ValueError(f"{name}_scale must be uint8 e8m0 [{num_rows}, {rows}, {groups}], "
                         f"got {scale.dtype} {list(scale.shape)}")  # fmt: skip
    if weight.stride(3) != 1 or weight.stride(2) != GROUP // 2 or scale.stride(2) != 1:
        raise ValueError(f"each row of {name} and {name}_scale must be contiguous")
    return Projection(weight, scale, tensors.get(f"{name}_bias"), columns, 1, 1)


def _check_call(hidden, topk_weights, topk_ids) -> None:
    check_router_call(hidden, topk_weights, topk_ids)
    if not runs_on(hidden):
        raise RuntimeError("the quantised apply needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    if hidden.dtype not in TOKEN_DTYPES:  # the kernels load and store these; others were served as they came
        raise TypeError(f"hidden must be fp32, fp16 or bf16, got {hidden.dtype}")
    if hidden.stride(1) != 1:
        raise ValueError(f"hidden must have contiguous rows, got strides {hidden.stride()}")
