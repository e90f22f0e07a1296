"""FP8 e4m3 expert weights with block or per-tensor scales: the on-disk format, in torch.

Two layouts of one format (``torch.float8_e4m3fn`` values, float32 scales, dequantised
value = fp8 value * scale), the weight of one projection being ``[..., N, K]`` (out, in)::

    block       weight [..., N, K] e4m3   scale [..., ceil(N/bn), ceil(K/bk)] fp32
                (DeepSeek-V3, Qwen3-FP8: ``weight_scale_inv``, bn = bk = 128; element
                (n, k) takes scale[n // bn, k // bk], the last row/column blocks ragged)
    per-tensor  weight [..., N, K] e4m3   scale [...] fp32, one per matrix (per expert)

The scale is what DeepSeek names ``weight_scale_inv``: the block's max magnitude over 448
(e4m3's largest finite value), so ``weight = fp8 * scale``. Quantising divides by it and
rounds to nearest e4m3 (torch's cast); an all-zero block gets scale 1. Nothing here is
used at run time: the store and the slots hold the packed tensors as they are, and the
kernels (`expertcache.kernels.quant_apply`) dequantise in registers.
"""

from __future__ import annotations

import torch

#: Largest finite e4m3 (``torch.finfo(torch.float8_e4m3fn).max``).
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight`` to e4m3 with one scale per ``block`` of (rows, columns).

    Args:
        weight: ``[..., N, K]`` floating point (any leading dimensions, e.g. experts).
        block: ``(bn, bk)`` rows and columns per scale block; N, K need not be multiples.

    Returns:
        ``(fp8 [..., N, K] float8_e4m3fn, scale [..., ceil(N/bn), ceil(K/bk)] float32)``.
    """
    rows, cols = weight.shape[-2:]
    bn, bk = check_fp8_block(block)
    padded = _pad_to_blocks(weight.float(), bn, bk)  # zeros never raise a block's max
    tiles = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., Gn, bn, Gk, bk]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., Gn, Gk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    quantized = quantized.flatten(-2).flatten(-3, -2)[..., :rows, :cols]
    return quantized.contiguous(), scale.contiguous()


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """``weight * scale of its block`` in float32.

    Args:
        weight: ``[..., N, K]`` float8_e4m3fn (or any float: the values are used as given).
        scale: ``[..., ceil(N/bn), ceil(K/bk)]`` float.
        block: ``(bn, bk)``.

    Returns:
        ``[..., N, K]`` float32.
    """
    rows, cols = weight.shape[-2:]
    bn, bk = check_fp8_block(block)
    expected = (*weight.shape[:-2], -(-rows // bn), -(-cols // bk))
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale must be {list(expected)} for weight {list(weight.shape)}, block {block}; "
                         f"got {list(scale.shape)}")  # fmt: skip
    full = scale.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return weight.float() * full[..., :rows, :cols]


def quantize_fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each ``[N, K]`` matrix of ``weight`` ``[..., N, K]`` with one scale.

    Returns:
        ``(fp8 [..., N, K] float8_e4m3fn, scale [...] float32)``.
    """
    rows, cols = weight.shape[-2:]
    quantized, scale = quantize_fp8_blocks(weight, (rows, cols))
    return quantized, scale[..., 0, 0].contiguous()


def dequantize_fp8_per_tensor(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight * scale`` per matrix: weight ``[..., N, K]``, scale ``[...]``; float32 ``[..., N, K]``."""
    if tuple(scale.shape) != tuple(weight.shape[:-2]):
        raise ValueError(f"scale must be {list(weight.shape[:-2])} (one per matrix), got {list(scale.shape)}")
    return weight.float() * scale.float()[..., None, None]


def check_fp8_block(block: object, name: str = "block") -> tuple[int, int]:
    """``block`` as ``(rows, columns)``: a pair of ints >= 1 (not bools: ``True`` is no size).

    Raises:
        ValueError: anything else (the message calls it ``name``).
    """
    if not (
        isinstance(block, tuple | list) and len(block) == 2 and all(type(size) is int and size >= 1 for size in block)
    ):
        raise ValueError(f"{name} must be two positive ints (rows, columns), got {block!r:.60}")
    return block[0], block[1]


def _pad_to_blocks(weight: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    rows, cols = weight.shape[-2:]
    return torch.nn.functional.pad(weight, (0, -cols % bk, 0, -rows % bn))
