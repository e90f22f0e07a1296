"""What a `DecodeStack` checks before any layer runs: its layers' expert count at
construction, and each step's inputs (activations, routing ids, predictions and the caches
that take them). A refusal raises before any layer's call, so nothing changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from expertcache.provider import ExpertWeightProvider

if TYPE_CHECKING:
    from expertcache.decode_stack import DecodeStack


def check_router_width(providers: Sequence[ExpertWeightProvider], num_experts: int) -> None:
    """The router picks among ``num_experts``: every provider that says how many experts its
    layer has (``num_global_experts``) must have as many, or a later layer would refuse the
    ids after the layers before it had run."""
    for index, provider in enumerate(providers):
        experts = getattr(provider, "num_global_experts", None)
        if experts is not None and experts != num_experts:
            raise ValueError(
                f"num_experts={num_experts} (the router's width) but layer {index}'s provider serves {experts} "
                f"experts; give the stack its layers' expert count"
            )


def check_step(stack: DecodeStack, hidden: torch.Tensor, routing: torch.Tensor) -> None:
    """Before any layer runs: ``hidden`` ``[T, H]``, ``routing`` ``[L, T, K]`` int ids in ``[0, E)``."""
    for name, tensor in (("hidden", hidden), ("routing", routing)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if not stack.providers:
        return
    hidden_size, num_experts = stack.router[0].shape
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden must be [T, H={hidden_size}], got {tuple(hidden.shape)}")
    if routing.dim() != 3 or routing.shape[0] != stack.num_layers or routing.shape[1] != hidden.shape[0]:
        raise ValueError(f"routing must be [L={stack.num_layers}, T={hidden.shape[0]}, K], got {tuple(routing.shape)}")
    if routing.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"routing must hold int32 or int64 ids, got {routing.dtype}")
    if routing.device != hidden.device:
        raise ValueError(f"routing is on {routing.device}, hidden on {hidden.device}")
    if hidden.dtype != stack.router[0].dtype or hidden.device != stack.router[0].device:
        raise TypeError(
            f"hidden must be {stack.router[0].dtype} on {stack.router[0].device} (the stack's dtype and "
            f"device), got {hidden.dtype} on {hidden.device}"
        )
    capturing = routing.is_cuda and torch.cuda.is_current_stream_capturing()
    if routing.numel() and not capturing:  # one sync in an eager step; a graph replays checked shapes
        low, high = int(routing.min()), int(routing.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"routing ids must lie in [0, {num_experts}), got {low}..{high}")


def check_prefetch(stack: DecodeStack, prefetch: torch.Tensor, routing: torch.Tensor) -> None:
    """Before any layer runs: predictions of the right shape, and caches that prefetch."""
    if not isinstance(prefetch, torch.Tensor) or prefetch.dim() != 3 or prefetch.shape[:2] != routing.shape[:2]:
        shape = tuple(prefetch.shape) if isinstance(prefetch, torch.Tensor) else type(prefetch).__name__
        raise ValueError(f"prefetch must be [L, T, P] like routing's [L, T, K] {tuple(routing.shape)}, got {shape}")
    first = 0 if stack.across_steps else 1  # layer 0 gets rows only when hand-offs wrap
    for index, provider in enumerate(stack.providers[first:], start=first):
        if getattr(provider, "mode", None) != "device" or not hasattr(provider, "prefetch"):
            raise ValueError(
                f"prefetch needs device-mode caches for layers {first}..{stack.num_layers - 1}; layer {index} is "
                f"{type(provider).__name__}{' in host mode' if getattr(provider, 'mode', None) == 'host' else ''}"
            )
        check = getattr(provider, "check_prefetch", None)
        if check is not None:  # as its prefetch would: count, dtype, device, a pool of its own
            check(prefetch[index])
