"""What a transformers experts implementation computes on: a `SlotView` of the slots.

A served call hands the implementation the module it wraps with its per-expert parameters
replaced by slot tensors ``[N, ...]`` and ``num_experts`` by ``N``: the whole pool (``N =
S``, no copy) while ``S`` is within what the implementation handles uncached: any ``S`` for
``batched_mm`` (it gathers ``w[ids]`` itself), at most `GROUPED_MM_MAX_GROUPS` for
``grouped_mm`` (torch's kernel refuses more groups), at most the layer's experts ``E`` for
every other one (``eager`` builds ``one_hot(ids, N + 1)``, ``[T, K, N + 1]`` int64). A larger
pool (a global budget over many layers) is compacted per pass (`present`): only the pass's
slots, gathered into ``[N, ...]`` with ids renumbered ``0..N-1``; ``N`` is their number
eagerly and a fixed ``min(E, T*K, S)`` inside a CUDA graph (`compact_slots`, no sync).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping

import torch
from torch import nn

#: The most groups (experts) torch's ``grouped_mm`` takes in one call on CUDA.
GROUPED_MM_MAX_GROUPS = 1024


class SlotView:
    """Stands in for an experts module during one call, reading slot tensors.

    Attribute lookups fall through to the module, except the per-expert parameters (slot
    tensors ``[N, ...]``) and ``num_experts`` (``N``). Methods defined on the module's
    class are bound to the view, so helpers that read weights through ``self`` read slots.
    """

    __slots__ = ("_module", "_tensors")

    def __init__(self, module: nn.Module, tensors: Mapping[str, torch.Tensor | int | bool], num_slots: int) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_tensors", {**tensors, "num_experts": num_slots})

    def with_sentinels(self) -> SlotView:
        """The same view, telling transformers' implementations that ids ``>= num_experts``
        are expert-parallel sentinels (``_is_expert_parallel``): skipped or weighted 0."""
        tensors = object.__getattribute__(self, "_tensors")
        module = object.__getattribute__(self, "_module")
        return SlotView(module, {**tensors, "_is_expert_parallel": True}, tensors["num_experts"])

    def __getattr__(self, name: str):
        tensors = object.__getattribute__(self, "_tensors")
        if name in tensors:
            return tensors[name]
        module = object.__getattribute__(self, "_module")
        attribute = inspect.getattr_static(type(module), name, None)
        if isinstance(attribute, types.FunctionType):
            return types.MethodType(attribute, self)
        return getattr(module, name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"SlotView is read-only (tried to set {name!r})")


def most_experts(implementation: str, num_experts: int) -> int | None:
    """The largest ``N`` an implementation is handed uncompacted (None: any)."""
    if implementation == "batched_mm":
        return None
    if implementation == "grouped_mm":
        return GROUPED_MM_MAX_GROUPS
    return num_experts


def present(
    module: nn.Module,
    tensors: dict[str, torch.Tensor],
    ids: torch.Tensor,
    *,
    implementation: str,
    num_experts: int,
    fixed: bool,
) -> tuple[SlotView, torch.Tensor]:
    """The `SlotView` and ids to hand an implementation: the pool as it is, or (a pool
    larger than the implementation handles) only the slots ``ids`` use, renumbered.

    Args:
        module: the served experts module.
        tensors: parameter name -> ``[S, ...]`` slot tensor of the pool.
        ids: ``[T, K]`` slot ids, every one a slot of this pass (no -1).
        implementation: the registry name of what will compute on the view.
        num_experts: the layer's experts ``E``.
        fixed: inside a CUDA-graph capture: a fixed-size table, no host sync.
    """
    num_slots = next(iter(tensors.values())).shape[0]
    limit = most_experts(implementation, num_experts)
    if limit is None or num_slots <= limit or ids.numel() == 0:
        return SlotView(module, tensors, num_slots), ids
    if fixed:
        size = min(num_experts, ids.numel(), num_slots)
        table, local = compact_slots(ids, size)
    else:
        table, local = torch.unique(ids, return_inverse=True)
    gathered = {name: tensor.index_select(0, table) for name, tensor in tensors.items()}
    return SlotView(module, gathered, int(table.numel())), local


def compact_slots(ids: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct values of ``ids`` in a ``[size]`` table, and ``ids`` renumbered into it,
    with fixed shapes and no host sync (CUDA-graph capturable).

    Args:
        ids: ``[T, K]`` non-negative slot ids with at most ``size`` distinct values.
        size: the table's length, ``>= 1``.

    Returns:
        ``table`` ``[size]`` (the distinct ids ascending, the unused tail repeating the
        smallest id) and ``local`` ``[T, K]`` int64 with ``table[local] == ids``.
    """
    flat = ids.reshape(-1)
    ordered, order = torch.sort(flat)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    rank = torch.cumsum(first, 0) - 1  # the table entry of each sorted id
    table = ordered[:1].expand(size).clone()
    table.scatter_(0, rank, ordered)  # equal ids write equal values: deterministic
    local = torch.empty_like(rank).scatter_(0, order, rank)
    return table, local.view(ids.shape)
