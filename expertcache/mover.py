"""Moving planned experts into their slots, and putting slots back when a call rolls back.

Two ways to execute a plan, with the same result in the slot tensors:

* ``"engine"``: the plan is known on the host (host mode); each missed expert's tensors go
  host -> slot with the copy engine (``copy_`` from pinned memory, non-blocking, on the
  current stream: ordered after every earlier kernel that read the slot, before this
  call's kernels). One copy per registered tensor.
* ``"kernel"``: the plan lives on the device (device mode, or host mode after uploading
  it); one launch of the copy kernel (`expertcache.kernels.copy_experts`) per group of up
  to eight tensors reads mapped pinned memory and writes every tensor of every planned
  expert. The only way inside a CUDA graph.

`restore_slots` undoes a plan's copies: a slot that held a victim gets the victim's
bytes back from its store, a slot that was free gets the poison again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from expertcache.call_plan import Load
from expertcache.kernels.copy_experts import (
    DEFAULT_BLOCK,
    MAX_TENSORS,
    CopyPlan,
    Segments,
    build_segments,
    copy_experts,
)
from expertcache.store import CPUBackingStore

MOVERS = ("engine", "kernel")

#: Byte every free slot is filled with: NaN in every float format, which a correct remap never lets a kernel read.
POISON = 0xFF

#: How the engine copies one expert: ``[(slot tensor, store tensor), ...]`` -> None.
CopyExpert = Callable[[Sequence[tuple[torch.Tensor, torch.Tensor]]], None]


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(destination, source)`` pair with the copy engine, non-blocking."""
    for destination, source in pairs:
        destination.copy_(source, non_blocking=True)


def copy_with_engine(
    slots: Mapping[str, torch.Tensor], store: CPUBackingStore, loads: Sequence[Load], key_offset: int, hook: CopyExpert
) -> None:
    """Copy every load's expert (key ``key_offset + expert`` of ``store``) into its slot."""
    for load in loads:
        expert = int(load.key) - key_offset  # type: ignore[call-overload]
        hook([(slots[name][load.slot], store.tensors[name][expert]) for name in slots])


@dataclass(frozen=True)
class CopyGroup:
    """Up to eight of a layer's tensors, copied by one kernel launch."""

    names: tuple[str, ...]
    segments: Segments


def copy_groups(store: CPUBackingStore) -> tuple[CopyGroup, ...]:
    """The launches that copy one expert of ``store``'s layout into the slot tensors."""
    layout = store.layout
    offsets = dict(zip((spec.name for spec in layout.specs), layout.region_offsets(store.num_experts), strict=True))
    groups = []
    for start in range(0, len(layout.specs), MAX_TENSORS):
        specs = layout.specs[start : start + MAX_TENSORS]
        segments = build_segments(
            tuple(offsets[spec.name] for spec in specs), tuple(spec.nbytes for spec in specs),
            layout.copy_unit, DEFAULT_BLOCK,
        )  # fmt: skip
        groups.append(CopyGroup(tuple(spec.name for spec in specs), segments))
    return tuple(groups)


def copy_with_kernel(
    slots: Mapping[str, torch.Tensor], store: CPUBackingStore, plan: torch.Tensor, groups: Sequence[CopyGroup]
) -> None:
    """Execute ``plan`` (on the device) from ``store`` into the slot tensors: one launch per group."""
    for group in groups:
        copy_experts(
            store.buffer, [slots[name] for name in group.names], CopyPlan.of(plan), group.segments,
            unit=store.layout.copy_unit, num_experts=store.num_experts,
        )  # fmt: skip


def restore_slots(
    slots: Mapping[str, torch.Tensor],
    loads: Sequence[Load],
    owner_of: Callable[[object], tuple[CPUBackingStore, int]],
) -> None:
    """Put back what ``loads`` overwrote (enqueued after the copies, on the same stream).

    Args:
        slots: the pool's slot tensors by name.
        loads: the plan's loads.
        owner_of: key -> (its layer's store, its local expert), for the victims.
    """
    for load in loads:
        if load.evicted is None:
            for tensor in slots.values():
                tensor[load.slot : load.slot + 1].view(torch.uint8).fill_(POISON)
            continue
        store, expert = owner_of(load.evicted)
        copy_pairs([(slots[name][load.slot], store.tensors[name][expert]) for name in slots])
