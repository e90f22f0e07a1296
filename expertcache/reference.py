"""The pure-torch MoE references that tests and benchmarks compare against, in one place.

For every (token t, choice k) with expert e = topk_ids[t, k] != -1::

    gate, up = chunk(x_t @ w1[e].T, 2)          # w1[e]: [2I, H], gate rows first
    y_tk     = (act(gate) * up) @ w2[e].T       # w2[e]: [H, I]
    out_t    = sum_k topk_weights[t, k] * y_tk  # summed in k order

Rows are grouped by expert id, so the same rows meet the same weights in the same order
whatever index space the ids live in: a provider's slot ids give bit-identical results to
the full weights on a CPU. `expert_outputs` (the ``y_tk``) and `combine_expert_outputs`
(the weighted k-order sum) are the two halves of `moe_forward`, exposed so that expert
parallelism can compute ``y_tk`` on the rank owning the expert and still sum exactly as here.

`gated_moe_forward` is the gated MLP of a quantisation scheme (`expertcache.quant.QuantScheme`:
gate/up layout, activation, biases; its formula in `expertcache.quant`) on float weights, the
same way, summed by `combine_expert_outputs`; `quant_moe_forward` runs it in float32 on a
scheme's dequantised tensors: the reference of the quantised apply kernels
(`expertcache.kernels.quant_apply`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from expertcache.quant import QuantScheme
from expertcache.quant_checks import (
    _check_biases,
    _check_float_experts,
    check_router_call,
    check_scheme,
    check_unregistered,
)
from expertcache.quant_tensors import dequantize_experts, weights_of
from expertcache.result import ExpertWeightResult

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
}


def moe_forward(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """Mixture-of-experts feed-forward, the slow and obvious way.

    Args:
        hidden: ``[T, H]`` float tokens.
        w1: ``[N, 2I, H]`` gate then up projections, indexed by ``topk_ids``.
        w2: ``[N, H, I]`` down projections.
        topk_weights: ``[T, K]`` router weights.
        topk_ids: ``[T, K]`` int ids into ``w1``/``w2``; -1 = skip (contributes nothing).
        activation: ``"silu"`` (default) or ``"gelu"`` applied to the gate.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype.
    """
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T, K]"
        )
    per_choice = expert_outputs(hidden, w1, w2, topk_ids, activation=activation)
    return combine_expert_outputs(per_choice, topk_weights)


def expert_outputs(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """The unweighted output ``y_tk`` of every (token, choice): `moe_forward` before the sum.

    Args:
        hidden, w1, w2, topk_ids, activation: as in `moe_forward`.

    Returns:
        ``[T, K, H]`` in ``hidden``'s dtype; zeros where ``topk_ids`` is -1.
    """
    try:
        act = ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"unknown activation {activation!r}; known: {sorted(ACTIVATIONS)}") from None
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    tokens, top_k = topk_ids.shape
    per_choice = hidden.new_zeros(tokens, top_k, w2.shape[1])  # y_tk, [T, K, H]
    for expert in torch.unique(topk_ids).tolist():
        if expert == -1:
            continue
        token_idx, choice_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate, up = (hidden[token_idx] @ w1[expert].T).chunk(2, dim=-1)
        per_choice[token_idx, choice_idx] = (act(gate) * up) @ w2[expert].T
    return per_choice


def combine_expert_outputs(per_choice: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``out_t = sum_k topk_weights[t, k] * y_tk``, summed in k order.

    Args:
        per_choice: ``[T, K, H]`` from `expert_outputs`.
        topk_weights: ``[T, K]`` router weights.

    Returns:
        ``[T, H]`` in ``per_choice``'s dtype. Each row depends only on its own inputs, so
        combining a slice of tokens gives bit-identical rows to combining the whole batch.
    """
    weighted = per_choice * topk_weights.to(per_choice.dtype).unsqueeze(-1)
    out = weighted[:, 0]
    for k in range(1, per_choice.shape[1]):
        out = out + weighted[:, k]
    return out


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
