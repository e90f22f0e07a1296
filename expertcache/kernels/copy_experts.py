"""Copy kernel: move every registered tensor of the planned experts host -> slots in one launch.

The plan stays on the device (a `CopyPlan`: how many copies, and per copy a store row and
a slot, e.g. the entries of the pool's plan, `expertcache.kernels.slot_tables`), so the
step needs no host read and the launch replays in a CUDA graph. On a GPU the source is
pinned host memory read through its mapped device address (UVA).

The source is one flat byte buffer carved into one ``[E, *shape]`` region per tensor name
(`expertcache.layout`); the destinations are the pool's slot tensors, one contiguous
``[S, *shape]`` allocation per name (up to ``MAX_TENSORS`` per launch; the launcher splits
larger sets). `Segments` says, per name, in copy words (``unit`` bytes each), where its
region starts and how many words one expert has, so expert ``e`` of name ``n`` is
``source[offset[n] + e * words[n] ...]`` and slot ``s`` is ``slots[n][s * words[n] ...]``.
Each expert is cut into chunks of ``BLOCK`` words per name, dealt to a fixed number of
programs. Copies naming a row or slot out of range are skipped. On sm_90 and later the
launch is chained to the admission before it (`expertcache.kernels._launch.chained`): its
programs start while the admission runs and wait on the GPU for its plan.

Given a ``landed`` counter per slot (`expertcache.kernels.landing`), the chunks stored into
a slot add to its count (``landed_counts``, per name), so ``landed[slot]`` reaches the
expert's target when its last byte is in the slot, and an apply kernel can start on each
expert (or on the names it reads first) as it lands instead of waiting for the whole launch.

This module owns the plan and segment types, the launcher (`copy_experts`) and its
reference (`copy_experts_torch`); the kernel, and how it reads and counts, is in
`expertcache.kernels.copy_experts_kernels`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from expertcache.kernels._launch import chained, runs_on
from expertcache.kernels.copy_experts_kernels import _copy_experts_kernel
from expertcache.kernels.landing import check_landed

# Measured on an H200 (benchmarks/README.md): 64 x 4096 is best or within 2 GB/s of the best
# grid for 1 to 32 experts of 9.4 MB and 44 MB.
DEFAULT_PROGRAMS = 64
DEFAULT_BLOCK = 4096  # words per chunk
_WORD = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


#: Slot tensors one launch writes (kernel arguments ``slots0 .. slots7``).
MAX_TENSORS = 8


class CopyPlan(NamedTuple):
    """Copies on the device: ``num_copies[0]`` of them; copy r takes store row
    ``experts[stride * r]`` into slot ``slots[stride * r]`` (int32 or int64 tensors, read
    without a host sync)."""

    num_copies: torch.Tensor
    experts: torch.Tensor
    slots: torch.Tensor
    stride: int

    @classmethod
    def of(cls, plan: torch.Tensor) -> CopyPlan:
        """The copies of a pool's ``[1 + 4 S]`` plan (count, then expert, slot, key, evicted)."""
        return cls(plan[:1], plan[1:], plan[2:], 4)


class Segments(NamedTuple):
    """Where each of up to ``MAX_TENSORS`` names lives in the source, in copy words.

    Attributes:
        offsets: first word of each name's region in the source buffer.
        words: words of one expert of each name.
        first_chunks: first chunk (of an expert's ``chunks_per_expert``) of each name.
        chunks_per_expert: chunks of ``block`` words one expert takes, over all names.
        block: words per chunk.
        align: words (4, 2 or 1) that divide every offset and size (loads that wide).
    """

    offsets: tuple[int, ...]
    words: tuple[int, ...]
    first_chunks: tuple[int, ...]
    chunks_per_expert: int
    block: int
    align: int


def build_segments(source_offsets: tuple[int, ...], expert_bytes: tuple[int, ...], unit: int, block: int) -> Segments:
    """The `Segments` of names whose regions start at ``source_offsets`` (bytes) and whose
    experts take ``expert_bytes``, copied in words of ``unit`` bytes, ``block`` words a chunk."""
    if not 1 <= len(source_offsets) <= MAX_TENSORS:
        raise ValueError(f"a launch copies 1 to {MAX_TENSORS} tensors, got {len(source_offsets)}")
    for offset, nbytes in zip(source_offsets, expert_bytes, strict=True):
        if offset % unit or nbytes % unit:
            raise ValueError(f"offsets and sizes must be multiples of the copy word ({unit} bytes)")
    offsets = tuple(offset // unit for offset in source_offsets)
    words = tuple(nbytes // unit for nbytes in expert_bytes)
    chunks = [triton.cdiv(count, block) for count in words]
    first_chunks = tuple(sum(chunks[:index]) for index in range(len(chunks)))
    return Segments(offsets, words, first_chunks, sum(chunks), block, math.gcd(4, *offsets, *words))


def copy_experts_torch(
    source: torch.Tensor,
    slots: list[torch.Tensor],
    plan: CopyPlan,
    segments: Segments,
    *,
    unit: int,
    landed: torch.Tensor | None = None,
    landed_counts: tuple[int, ...] | None = None,
) -> None:
    """Reference of `copy_experts`: for every planned copy, each name's expert words into its
    slot (and what its chunks count added to ``landed[slot]``)."""
    counts = _counts(segments, landed_counts)
    per_expert = sum(chunks * count for chunks, count in zip(segment_chunks(segments), counts, strict=True))
    source_words = source.view(_WORD[unit])
    count = int(plan.num_copies.reshape(-1)[0])
    experts = plan.experts[: plan.stride * count : plan.stride].tolist()
    slot_ids = plan.slots[: plan.stride * count : plan.stride].tolist()
    for expert, slot in zip(experts, slot_ids, strict=True):
        for offset, words, tensor in zip(segments.offsets, segments.words, slots, strict=True):
            chunk = source_words[offset + expert * words : offset + (expert + 1) * words]
            tensor.reshape(-1).view(_WORD[unit])[slot * words : (slot + 1) * words] = chunk.to(tensor.device)
        if landed is not None:
            landed[slot] += per_expert


def copy_experts(
    source: torch.Tensor,
    slots: list[torch.Tensor],
    plan: CopyPlan,
    segments: Segments,
    *,
    unit: int,
    num_experts: int,
    num_programs: int | None = None,
    landed: torch.Tensor | None = None,
    landed_counts: tuple[int, ...] | None = None,
) -> None:
    """Copy the planned experts without reading the plan on the host.

    Args:
        source: ``[bytes]`` uint8 store buffer: pinned host memory (GPU slots) or any CPU
            tensor (interpreted).
        slots: the ``[S, *shape]`` contiguous slot tensors on the device, one per name of
            ``segments`` (at most ``MAX_TENSORS``).
        plan: the copies, on the slots' device (`CopyPlan`; a pool's: ``CopyPlan.of(plan)``).
        segments: from `build_segments`.
        unit: bytes of a copy word (4, 2 or 1).
        num_experts: rows of the store (copies naming others are skipped).
        num_programs: programs of the persistent grid (fixed: graph-safe); default
            ``DEFAULT_PROGRAMS`` on a GPU, 2 when interpreted (programs run one by one there).
        landed: optional ``[S]`` int32 counters on the slots' device: each stored chunk of
            segment ``n`` adds ``landed_counts[n]`` to its slot's (`expertcache.kernels.landing`).
        landed_counts: positive ints, one per segment (default 1 each: ``landed[slot]``
            grows by ``segments.chunks_per_expert`` per copy).
    """
    if source.dtype != torch.uint8 or source.dim() != 1:
        raise ValueError("source must be a flat uint8 buffer")
    if len(slots) != len(segments.words):
        raise ValueError(f"give one slot tensor per segment ({len(segments.words)}), got {len(slots)}")
    if any(not t.is_contiguous() or t.device != slots[0].device for t in slots):
        raise ValueError("slot tensors must be contiguous and on one device")
    if not runs_on(slots[0]):
        raise RuntimeError("the copy kernel needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    if landed is not None:
        check_landed(landed, slots[0].shape[0], slots[0].device)
    counts = _counts(segments, landed_counts)
    word = _WORD[unit]
    if num_programs is None:
        num_programs = DEFAULT_PROGRAMS if slots[0].is_cuda else 2
    if slots[0].is_cuda and not source.is_cuda:
        if not source.is_pinned():
            raise ValueError("the source buffer must be pinned to be read by the GPU")
        source_arg: object = MappedHostPointer(source, word)
    else:
        source_arg = source.view(word)
    pad = MAX_TENSORS - len(slots)
    destinations = [t.reshape(-1).view(word) for t in slots] + [slots[0].reshape(-1).view(word)] * pad
    _copy_experts_kernel[(num_programs,)](
        source_arg, *destinations, plan.num_copies, plan.experts, plan.slots, plan.stride,
        *segments.offsets, *(0,) * pad, *segments.words, *(0,) * pad, *segments.first_chunks[1:], *(0,) * pad,
        num_experts, slots[0].shape[0], segments.chunks_per_expert,
        landed if landed is not None else plan.num_copies, *counts, *(0,) * pad,
        BLOCK=segments.block, NUM_PROGRAMS=num_programs, NUM_SEGMENTS=len(slots), ALIGN=segments.align,
        SIGNAL=landed is not None, num_warps=warps_for(segments.block), **chained(slots[0].device),
    )  # fmt: skip


def segment_chunks(segments: Segments) -> tuple[int, ...]:
    """Chunks one expert takes in each segment."""
    ends = (*segments.first_chunks[1:], segments.chunks_per_expert)
    return tuple(end - first for first, end in zip(segments.first_chunks, ends, strict=True))


def _counts(segments: Segments, landed_counts: tuple[int, ...] | None) -> tuple[int, ...]:
    """What one chunk of each segment counts (checked: a positive int per segment, and an
    expert's total within int32)."""
    if landed_counts is None:
        return (1,) * len(segments.words)
    if len(landed_counts) != len(segments.words) or any(
        isinstance(count, bool) or not isinstance(count, int) or count < 1 for count in landed_counts
    ):
        raise ValueError(
            f"landed_counts must be a positive int per segment ({len(segments.words)}), got {landed_counts!r}"
        )
    if sum(c * n for c, n in zip(landed_counts, segment_chunks(segments), strict=True)) > 2**31 - 1:
        raise ValueError("landed_counts overflow an int32 counter over one expert")
    return tuple(landed_counts)


def warps_for(block: int) -> int:
    """Warps per copy program: more words per chunk, more loads in flight."""
    return min(16, max(4, block // 512))


class MappedHostPointer:
    """Pinned host memory presented to Triton by address (the launcher maps it to the GPU)."""

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        self._tensor = tensor  # keeps the memory alive
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._tensor.data_ptr()
