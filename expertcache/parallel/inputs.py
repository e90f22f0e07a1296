"""Checks of what expert parallelism is given, run before any cache or collective acts.

`LocalExperts` computes with the pure-torch reference (`expertcache.reference.expert_outputs`),
which reads ``w1`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` only and multiplies ``hidden`` by
them in their own dtype; these checks turn every input that reference would reject (or
silently drop) into a clear error before the provider admits or copies anything.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from expertcache.layout import ExpertLayout, layout_from_weights
from expertcache.parallel.partition import ExpertPartition
from expertcache.reference import ACTIVATIONS
from expertcache.store import CPUBackingStore
from expertcache.validation import is_dense

#: The dtypes the reference's torch matmuls take; every rank codes them alike for the
#: cross-rank agreement (`expertcache.parallel.agreement`).
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_activation(activation: object) -> str:
    """``activation`` is a name the reference knows (``"silu"`` or ``"gelu"``)."""
    if not isinstance(activation, str):
        raise TypeError(f"activation must be one of {sorted(ACTIVATIONS)}, got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; known: {sorted(ACTIVATIONS)}")
    return activation


def check_partition(partition: object) -> ExpertPartition:
    if not isinstance(partition, ExpertPartition):
        raise TypeError(f"partition must be an ExpertPartition, got {type(partition).__name__}")
    return partition


def computed_layout(weights: object) -> tuple[int, ExpertLayout]:
    """``(experts, layout)`` of ``weights`` (a mapping or a `CPUBackingStore`), refused unless the
    reference computes with all of it: exactly ``w1`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]``
    in one of `COMPUTE_DTYPES` (scales, biases or packed formats would be ignored)."""
    if isinstance(weights, CPUBackingStore):
        num_experts, layout = weights.num_experts, weights.layout
    elif isinstance(weights, Mapping):
        num_experts, layout = layout_from_weights(weights)
    else:
        raise TypeError(f"weights must map names to tensors or be a CPUBackingStore, got {type(weights).__name__}")
    specs = {spec.name: spec for spec in layout.specs}
    extra = sorted(set(specs) - {"w1", "w2"})
    if extra:
        raise ValueError(f"LocalExperts computes with w1 and w2 only; it would ignore {extra}")
    w1, w2 = specs["w1"], specs["w2"]
    if w1.dtype != w2.dtype or w1.dtype not in COMPUTE_DTYPES:
        raise TypeError(f"w1 and w2 must share one of {[str(d) for d in COMPUTE_DTYPES]}, got {w1.dtype}, {w2.dtype}")
    if len(w1.shape) != 2 or len(w2.shape) != 2 or w1.shape != (2 * w2.shape[1], w2.shape[0]):
        raise ValueError(f"experts must be w1 [2I, H] and w2 [H, I] (x @ W.T), got {list(w1.shape)}, {list(w2.shape)}")
    return num_experts, layout


def check_full_weights(weights: object, num_experts: int) -> Mapping[str, torch.Tensor]:
    """``{name: [E, ...]}`` holding every expert of a partition of ``num_experts``."""
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must map names to [E, ...] tensors, got {type(weights).__name__}")
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
            raise TypeError(f"weights[{name!r}] must be a tensor [E, ...], got {type(tensor).__name__}")
        if tensor.shape[0] != num_experts:
            raise ValueError(
                f"weights[{name!r}] holds {tensor.shape[0]} experts, but the partition places {num_experts}"
            )
    return weights


def check_hidden(hidden: object, *, tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """``hidden`` is a dense ``[tokens, hidden_size]`` tensor of ``dtype`` on ``device``."""
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a tensor, got {type(hidden).__name__}")
    if not is_dense(hidden):
        raise TypeError("hidden must be a dense (strided) tensor")
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden must be [T, H={hidden_size}], got shape {tuple(hidden.shape)}")
    if hidden.shape[0] != tokens:
        raise ValueError(f"hidden has {hidden.shape[0]} rows but topk_ids {tokens}: one routing row per token")
    if hidden.dtype != dtype:
        raise TypeError(f"hidden is {hidden.dtype}, but the experts compute in their weights' dtype {dtype}")
    if hidden.device != device:
        raise ValueError(f"hidden is on {hidden.device}, but the expert weights are on {device}")


def check_top_k(topk_ids: torch.Tensor) -> None:
    """``topk_ids`` (checked ``[T, K]``) holds at least one choice per token: the k-order sum
    of the reference has no K = 0 (it would fail after the cache had counted the call)."""
    if topk_ids.shape[1] == 0:
        raise ValueError(
            f"topk_ids must hold at least one choice per token (K >= 1), got shape {tuple(topk_ids.shape)}"
        )


def check_router_weights(topk_weights: object, topk_ids: torch.Tensor, hidden: torch.Tensor) -> None:
    """``topk_weights`` is ``[T, K]`` like ``topk_ids``, in ``hidden``'s dtype or float32 (what
    routers emit), on ``hidden``'s device."""
    if not isinstance(topk_weights, torch.Tensor):
        raise TypeError(f"topk_weights must be a tensor, got {type(topk_weights).__name__}")
    if not is_dense(topk_weights):
        raise TypeError("topk_weights must be a dense (strided) tensor")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must both be [T, K]"
        )
    if topk_weights.dtype not in (hidden.dtype, torch.float32):
        raise TypeError(f"topk_weights must be hidden's dtype ({hidden.dtype}) or float32, got {topk_weights.dtype}")
    if topk_weights.device != hidden.device:
        raise ValueError(f"topk_weights is on {topk_weights.device}, hidden on {hidden.device}")
