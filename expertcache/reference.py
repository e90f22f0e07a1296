"""The single pure-torch MoE reference that tests and benchmarks compare against.

For every (token t, choice k) with expert e = topk_ids[t, k] != -1::

    gate, up = chunk(x_t @ w1[e].T, 2)          # w1[e]: [2I, H], gate rows first
    y_tk     = (act(gate) * up) @ w2[e].T       # w2[e]: [H, I]
    out_t    = sum_k topk_weights[t, k] * y_tk  # summed in k order

Rows are grouped by expert id, so the same rows meet the same weights in the same order
whatever index space the ids live in: a provider's slot ids give bit-identical results to
the full weights on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

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
    try:
        act = ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"unknown activation {activation!r}; known: {sorted(ACTIVATIONS)}") from None
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T, K]"
        )
    tokens, top_k = topk_ids.shape
    per_choice = hidden.new_zeros(tokens, top_k, w2.shape[1])  # y_tk, [T, K, H]
    for expert in torch.unique(topk_ids).tolist():
        if expert == -1:
            continue
        token_idx, choice_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate, up = (hidden[token_idx] @ w1[expert].T).chunk(2, dim=-1)
        per_choice[token_idx, choice_idx] = (act(gate) * up) @ w2[expert].T
    weighted = per_choice * topk_weights.to(hidden.dtype).unsqueeze(-1)
    out = weighted[:, 0]
    for k in range(1, top_k):
        out = out + weighted[:, k]
    return out
