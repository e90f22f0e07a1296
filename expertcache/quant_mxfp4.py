"""MXFP4 expert weights in GPT-OSS's checkpoint layout: the on-disk format, in torch.

OCP microscaling FP4: groups of 32 consecutive input columns share one power-of-two scale.
One projection's weight ``[..., N, K]`` (out, in; GPT-OSS ``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``) is stored as::

    blocks  [..., N, G, 16] uint8   G = ceil(K/32); byte j of group g holds columns
                                    32g + 2j (low nibble) and 32g + 2j + 1 (high nibble)
    scales  [..., N, G]     uint8   e8m0: scale = 2 ** (code - 127)

    value(n, k) = E2M1[nibble] * 2 ** (scales[n, k // 32] - 127)

A nibble is e2m1 (sign, 2 exponent bits, 1 mantissa bit): codes 0-7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 their negatives (`E2M1_VALUES`, the order of
transformers' ``FP4_VALUES``). Columns past K in the last group are zero. This is what
GPT-OSS checkpoints hold as ``*_proj_blocks`` / ``*_proj_scales`` and what
``transformers.integrations.mxfp4.convert_moe_packed_tensors`` dequantises (it returns the
``[..., K, N]`` transpose, GPT-OSS's ``x @ W`` layout).

Quantising picks the smallest scale with ``max |x| / scale <= 6`` (nothing clips), then
rounds each value to the nearest e2m1 value (ties to the even code). Code 255 (NaN in
e8m0) is never written; code 0 (2 ** -127) decodes as zero in the kernels.
"""

from __future__ import annotations

import torch

from expertcache.validation import check_int

#: Value of each e2m1 code (index = nibble).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # columns per scale
E2M1_MAX = 6.0
E8M0_BIAS = 127


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight`` ``[..., N, K]`` to MXFP4 along its last dimension.

    Returns:
        ``(blocks [..., N, ceil(K/32), 16] uint8, scales [..., N, ceil(K/32)] uint8)``.
    """
    cols = weight.shape[-1]
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % GROUP))
    groups = padded.unflatten(-1, (-1, GROUP))  # [..., N, G, 32]
    amax = groups.abs().amax(dim=-1)
    # smallest e with amax / 2**e <= 6; frexp is exact where log2 would round
    mantissa, exponent = torch.frexp(amax / E2M1_MAX)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two needs no step up
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exponent.float())[..., None]
    codes = _nearest_e2m1(scaled)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks.contiguous(), (exponent + E8M0_BIAS).to(torch.uint8).contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, columns: int | None = None) -> torch.Tensor:
    """The float32 ``[..., N, K]`` weight of ``blocks`` / ``scales`` (see the module docstring).

    Args:
        blocks: ``[..., N, G, 16]`` uint8.
        scales: ``[..., N, G]`` uint8 e8m0.
        columns: ``K`` (default ``32 * G``), in ``(32 * (G - 1), 32 * G]``; the padding
            columns past it are dropped.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"blocks must be [..., N, G, 16] and scales [..., N, G]; got {list(blocks.shape)}, "
                         f"{list(scales.shape)}")  # fmt: skip
    if columns is not None:  # a K of other groups would drop real columns or keep padding
        groups = blocks.shape[-2]
        columns = check_int("columns", columns, minimum=GROUP * (groups - 1) + 1, maximum=GROUP * groups)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., N, G, 32], low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - E8M0_BIAS)
    out = values.flatten(-2)
    return out if columns is None else out[..., :columns]


def mxfp4_groups(columns: int) -> int:
    """``G``: scale groups (and 16-byte blocks) of a row of ``columns`` input columns."""
    return -(-columns // GROUP)


def _nearest_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """int64 e2m1 codes nearest to ``scaled`` (|scaled| <= 6), ties to the even code.

    The magnitude code counts the midpoints between neighbouring values that ``|scaled|``
    passes; at a midpoint whose lower neighbour has an even code the tie stays below (``>``),
    else it goes up (``>=``).
    """
    magnitude = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.int64, device=scaled.device)
    for lower, midpoint in enumerate((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)):
        code += (magnitude > midpoint if lower % 2 == 0 else magnitude >= midpoint).long()
    return code | (torch.signbit(scaled).long() << 3)
