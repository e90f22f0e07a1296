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
  would require grad (an input or one of the module's expert parameters does), the output
  carries a node whose backward raises, naming the cause;
* a backward that reaches that node raises before any gradient flows through the experts.
  The cache is not touched (a backward never calls it): it keeps serving as before.

Under ``torch.no_grad()``, ``torch.inference_mode()`` and ``generate()`` nothing here runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def without_backward(
    compute: Callable[[], torch.Tensor],
    where: str,
    hidden_states: torch.Tensor,
    top_k_weights: torch.Tensor,
    parameters: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """``compute()``, the served call on ``hidden_states`` and ``top_k_weights``, with no
    backward through it: where autograd would record the call (gradients enabled and an
    input or a parameter requiring grad), it runs unrecorded and its output's backward raises
    RuntimeError.

    Args:
        compute: runs the served call, returns ``[T, H]``.
        where: names the served module in the error (``"layer 3's Qwen3MoeExperts"``).
        hidden_states: ``[T, H]``, the call's tokens; top_k_weights: ``[T, K]`` router weights.
        parameters: the served module's expert parameters (its placeholders; read only with
            gradients enabled): the uncached call's output requires grad when one of them does
            (fine-tuning the experts with everything before them frozen), so the refusal hangs
            on them too.
    """
    if not torch.is_grad_enabled():
        return compute()
    inputs = [hidden_states, top_k_weights]
    if any(parameter.requires_grad for parameter in parameters):
        # a fresh leaf stands for the placeholders: autograd would keep their empty shape in a
        # graph still alive after disable() and refuse the full parameters' gradients then
        inputs.append(torch.empty(0, device=hidden_states.device, requires_grad=True))
    if any(tensor.requires_grad for tensor in inputs):
        return _RefusedBackward.apply(compute, where, *inputs)
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
