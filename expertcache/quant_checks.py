"""Input checks of the quantised-expert functions: a scheme, its tensors, a router call.

A scheme must be a `QuantScheme` (`check_scheme`: a format name alone says nothing of the
MLP), and scales or biases it does not register are refused, not dropped
(`check_unregistered`); a router call's ``hidden``, ``topk_weights`` and ``topk_ids`` must
agree (`check_router_call`); float experts ``w1`` ``[E, 2I, H]`` / ``w2`` ``[E, H, I]`` and
their biases must agree with each other and with the scheme (`_check_float_experts`,
`_check_biases`). `expertcache.quant_tensors`, the references in `expertcache.reference`, the
quantised apply kernels (`expertcache.kernels.quant_common`) and the transformers
integration share them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from expertcache.quant import QuantScheme


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
