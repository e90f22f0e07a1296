"""Moving planned experts into their slots, and putting slots back when a call rolls back.

Two ways to execute a plan, with the same result in the slot tensors:

* ``"engine"``: the plan is known on the host (host mode, and device mode's eager prefills,
  which read it back); each missed expert's tensors go host -> slot with the copy engine
  (``copy_`` from pinned memory, non-blocking, on the current stream: ordered after every
  earlier kernel that read the slot, before this call's kernels). One copy per registered
  tensor.
* ``"kernel"``: the plan lives on the device (device mode, or host mode after uploading
  it); one launch of the copy kernel (`expertcache.kernels.copy_experts`) per group of up
  to eight tensors reads mapped pinned memory and writes every tensor of every planned
  expert. The only way inside a CUDA graph.

Names a compressed store holds as records (`expertcache.compression`) are decoded on the
way: a `DecodeGroup` launches the decoding copy kernel (`expertcache.kernels.decode_copy`)
from the same device plan, in both ways (the engine cannot decode; host mode uploads its
plan first, so the kernel runs there too; without a GPU or the interpreter the kernel's
torch reference runs).

`restore_slots` undoes a plan's copies: a slot that held a victim gets the victim's
bytes back from its store, a slot that was free gets the poison again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from expertcache.call_plan import Load
from expertcache.kernels._launch import runs_on
from expertcache.kernels.copy_experts import (
    DEFAULT_BLOCK,
    MAX_TENSORS,
    CopyPlan,
    Segments,
    build_segments,
    copy_experts,
    segment_chunks,
)
from expertcache.kernels.decode_copy import MAX_TENSORS as MAX_DECODED
from expertcache.kernels.decode_copy import (
    DecodeSegments,
    build_decode_segments,
    decode_copy,
    decode_copy_torch,
    default_programs,
    scratch_bytes,
)
from expertcache.kernels.landing import Counting
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
    slots: Mapping[str, torch.Tensor],
    store: CPUBackingStore,
    loads: Sequence[Load],
    key_offset: int,
    hook: CopyExpert,
    plan: torch.Tensor,
    groups: Sequence[CopyGroup | DecodeGroup],
) -> None:
    """Copy every load's expert (key ``key_offset + expert`` of ``store``) into its slot: raw
    names by the engine (``hook``), coded ones by ``groups``' decode launches from ``plan``,
    the same loads on the device."""
    raw = [name for name in slots if name not in store.records]
    for load in loads:
        expert = int(load.key) - key_offset  # type: ignore[call-overload]
        hook([(slots[name][load.slot], store.tensors[name][expert]) for name in raw])
    if store.records and loads:
        copy_with_kernel(slots, store, plan, [group for group in groups if isinstance(group, DecodeGroup)])


@dataclass(frozen=True)
class CopyGroup:
    """Up to eight of a layer's tensors, copied by one kernel launch."""

    names: tuple[str, ...]
    segments: Segments
    unit: int = 0  # bytes of a copy word (4, 2 or 1); 0: the layout's


@dataclass(frozen=True)
class DecodeGroup:
    """Up to four of a layer's coded names (one code), decoded by one kernel launch.

    ``scratch``: the launch's staging buffer on the slots' device, allocated once (the
    launch allocates nothing, inside CUDA graphs too).
    """

    names: tuple[str, ...]
    segments: DecodeSegments
    scratch: torch.Tensor
    num_programs: int


def copy_groups(store: CPUBackingStore, device: torch.device | None = None) -> tuple[CopyGroup | DecodeGroup, ...]:
    """The launches that move one expert of ``store`` into slot tensors on ``device``
    (default CPU): copies of the raw names, decodes of the coded ones."""
    layout = store.layout
    offsets = dict(zip((spec.name for spec in layout.specs), store.region_offsets, strict=True))
    raw = [spec for spec in layout.specs if spec.name not in store.formats]
    unit = math.gcd(4, *(spec.nbytes for spec in raw))
    groups: list[CopyGroup | DecodeGroup] = []
    for start in range(0, len(raw), MAX_TENSORS):
        specs = raw[start : start + MAX_TENSORS]
        segments = build_segments(
            tuple(offsets[spec.name] for spec in specs), tuple(spec.nbytes for spec in specs), unit, DEFAULT_BLOCK
        )
        groups.append(CopyGroup(tuple(spec.name for spec in specs), segments, unit))
    by_code: dict[object, list[str]] = {}
    for name, fmt in store.formats.items():
        by_code.setdefault(fmt.code, []).append(name)
    target = torch.device("cpu") if device is None else device
    for names in by_code.values():
        for start in range(0, len(names), MAX_DECODED):
            chunk = tuple(names[start : start + MAX_DECODED])
            coded = build_decode_segments(
                tuple(offsets[name] for name in chunk), tuple(store.formats[name] for name in chunk)
            )
            programs = default_programs(target)
            with torch.inference_mode(False):
                scratch = torch.empty(scratch_bytes(coded, programs), dtype=torch.uint8, device=target)
            groups.append(DecodeGroup(chunk, coded, scratch, programs))
    return tuple(groups)


def landing_counting(groups: Sequence[CopyGroup | DecodeGroup]) -> Counting | None:
    """What one expert's copies over ``groups`` count into its landing counter
    (`expertcache.kernels.landing`); None when a group is decoded (no landing counts)."""
    copies = [group for group in groups if isinstance(group, CopyGroup)]
    if len(copies) != len(groups):
        return None
    chunks: dict[str, int] = {}
    for group in copies:
        chunks.update(zip(group.names, segment_chunks(group.segments), strict=True))
    return Counting.of(chunks)


def copy_with_kernel(
    slots: Mapping[str, torch.Tensor],
    store: CPUBackingStore,
    plan: torch.Tensor,
    groups: Sequence[CopyGroup | DecodeGroup],
    landed: torch.Tensor | None = None,
) -> None:
    """Execute ``plan`` (on the device) from ``store`` into the slot tensors: one launch per
    group; each counts its chunks into ``landed`` when given (copy groups only), as
    `landing_counting` says."""
    counting = landing_counting(groups) if landed is not None else None
    if landed is not None and counting is None:
        raise ValueError("landing counts need copy groups only (a decoded group counts nothing)")
    for group in groups:
        targets = [slots[name] for name in group.names]
        if isinstance(group, CopyGroup):
            copy_experts(
                store.buffer, targets, CopyPlan.of(plan), group.segments,
                unit=group.unit or store.layout.copy_unit, num_experts=store.num_experts, landed=landed,
                landed_counts=None if counting is None else tuple(counting.weights[name] for name in group.names),
            )  # fmt: skip
        elif runs_on(targets[0]):
            decode_copy(
                store.buffer, targets, CopyPlan.of(plan), group.segments, num_experts=store.num_experts,
                scratch=group.scratch, num_programs=group.num_programs,
            )  # fmt: skip
        else:  # a CPU without the interpreter (host mode): the reference decodes
            decode_copy_torch(store.buffer, targets, CopyPlan.of(plan), group.segments, num_experts=store.num_experts)


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
        copy_pairs([(slots[name][load.slot], store.expert(name, expert)) for name in slots])
