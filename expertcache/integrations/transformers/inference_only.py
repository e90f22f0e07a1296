"""Served experts are for inference: a backward through them is refused, a forward is not.

The slots a served call computes on are overwritten by the next call on the pool (its next
pass, the next layer of a shared pool), and the module's own expert parameters are empty
placeholders while served: autograd can differentiate neither through the slots (it failed
with "one of the variables needed for gradient computation has been modified by an inplace
operation") nor into the parameters. Where to refuse:

* a forward with gradients enabled runs. A model's parameters require grad by default, so
  its hidden states do too whenever ``torch.no_grad()`` is forgotten: refusing such a
  forward would refuse plain inference (``model(ids)``), which works uncached. The call is
  computed without recording a graph (no slot is kept for a backward) and, when its output
  would require grad, the output carries a node whose backward raises, naming the cause;
* a backward that reaches that node raises before any gradient flows through the experts.
  The cache is not touched (a backward never calls it): it keeps serving as before.

Under ``torch.no_grad()``, ``torch.inference_mode()`` and ``generate()`` nothing here runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def without_backward(
    compute: Callable[[], torch.Tensor], where: str, hidden_states: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``compute()``, the served call on ``hidden_states`` and ``top_k_weights``, with no
    backward through it: where autograd would record the call (gradients enabled and an
    input requiring grad), it runs unrecorded and its output's backward raises RuntimeError.

    Args:
        compute: runs the served call, returns ``[T, H]``.
        where: names the served module in the error (``"layer 3's Qwen3MoeExperts"``).
        hidden_states: ``[T, H]``, the call's tokens; top_k_weights: ``[T, K]`` router weights.
    """
    if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad):
        return _RefusedBackward.apply(compute, where, hidden_states, top_k_weights)
    return compute()


class _RefusedBackward(torch.autograd.Function):
    """Identity on a call computed inside (autograd records nothing in a Function's forward),
    with a backward that refuses."""

    @staticmethod
    def forward(ctx: Any, compute: Callable[[], torch.Tensor], where: str, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.where = where
        return compute()

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> None:
        raise RuntimeError(
            f"backward through {ctx.where}, served by an expert cache: the cache is for inference only "
            f"(the slots a call reads are overwritten by the next call and the expert parameters are empty "
            f"placeholders, so no gradient can flow through or into them). Run the model under torch.no_grad() or "
            f"torch.inference_mode() (generate() does), or call disable() on the ExpertCacheHandle before training "
            f"or taking gradients; the cache is unchanged"
        )
