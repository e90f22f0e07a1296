"""Copy kernel: move every registered tensor of the planned experts host -> slots in one launch.

The plan stays on the device (a `CopyPlan`: how many copies, and per copy a store row and
a slot, e.g. the entries of the pool's plan, `expertcache.kernels.slot_tables`), so the
step needs no host read and the launch replays in a CUDA graph. On a GPU the source is
pinned host memory read through its mapped device address (UVA).

The source is one flat byte buffer carved into one ``[E, *shape]`` region per tensor name
(`expertcache.layout`); the destinations are the pool's slot tensors, one contiguous
``[S, *shape]`` allocation per name (up to ``MAX_TENSORS`` per launch; the launcher splits
larger sets). A ``segments`` table gives, per name, in copy words (``unit`` bytes each)::

    segments [names, 3] int64:  source offset | words per expert | first chunk

so expert ``e`` of name ``n`` is ``source[src_off[n] + e * words[n] ...]`` and slot ``s``
is ``slots[n][s * words[n] ...]``. Each expert is cut into chunks of ``BLOCK`` words (per
name), dealt round-robin to a fixed number of programs, which keeps enough PCIe reads in
flight to approach the copy engine's bandwidth. Entries naming a row or slot out of range
are skipped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import runs_on

# Measured on an H200 (benchmarks/README.md): 64 x 4096 is best or within 2 GB/s of the best
# grid for 1 to 32 experts of 9.4 MB and 44 MB.
DEFAULT_PROGRAMS = 64
DEFAULT_BLOCK = 4096  # words per chunk
_WORD = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _copy_experts_kernel(
    source_ptr, slots0, slots1, slots2, slots3, slots4, slots5, slots6, slots7,
    count_ptr, experts_ptr, slot_ids_ptr, stride, segments_ptr, num_experts, num_slots, chunks_per_expert,
    BLOCK: tl.constexpr, NUM_PROGRAMS: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):  # fmt: skip
    count = tl.minimum(tl.load(count_ptr).to(tl.int32), num_slots)
    for work in range(tl.program_id(0), count * chunks_per_expert, NUM_PROGRAMS):
        rank = work // chunks_per_expert
        chunk = work % chunks_per_expert
        expert = tl.load(experts_ptr + stride * rank).to(tl.int64)
        slot = tl.load(slot_ids_ptr + stride * rank).to(tl.int64)
        segment = 0
        for n in tl.static_range(1, NUM_SEGMENTS):
            segment += (chunk >= tl.load(segments_ptr + 3 * n + 2)).to(tl.int32)
        row = segments_ptr + 3 * segment
        words = tl.load(row + 1)
        offsets = (chunk - tl.load(row + 2)) * BLOCK + tl.arange(0, BLOCK)
        ok = (expert >= 0) & (expert < num_experts) & (slot >= 0) & (slot < num_slots)
        mask = offsets < tl.where(ok, words, 0)
        values = tl.load(source_ptr + tl.load(row) + expert * words + offsets, mask=mask)
        destination = slots0
        if segment == 1:
            destination = slots1
        if segment == 2:
            destination = slots2
        if segment == 3:
            destination = slots3
        if segment == 4:
            destination = slots4
        if segment == 5:
            destination = slots5
        if segment == 6:
            destination = slots6
        if segment == 7:
            destination = slots7
        tl.store(destination + slot * words + offsets, values, mask=mask)


#: Slot tensors one launch writes (kernel arguments ``slots0 .. slots7``).
MAX_TENSORS = 8


class CopyPlan(NamedTuple):
    """Copies on the device: ``count[0]`` of them; copy r takes store row ``experts[stride * r]``
    into slot ``slots[stride * r]`` (int32 or int64 tensors, read without a host sync)."""

    count: torch.Tensor
    experts: torch.Tensor
    slots: torch.Tensor
    stride: int

    @classmethod
    def of(cls, plan: torch.Tensor) -> CopyPlan:
        """The copies of a pool's ``[1 + 4 S]`` plan (count, then expert, slot, key, evicted)."""
        return cls(plan[:1], plan[1:], plan[2:], 4)


def build_segments(
    source_offsets: tuple[int, ...], expert_bytes: tuple[int, ...], unit: int, block: int
) -> tuple[torch.Tensor, int]:
    """The ``[names, 3]`` int64 segments table (CPU) and the chunks of one expert.

    Args:
        source_offsets: byte offset of each name's region in the source buffer.
        expert_bytes: bytes of one expert of each name.
        unit: bytes of a copy word; must divide every offset and size.
        block: words per chunk.
    """
    rows, first = [], 0
    for src, nbytes in zip(source_offsets, expert_bytes, strict=True):
        if src % unit or nbytes % unit:
            raise ValueError(f"offsets and sizes must be multiples of the copy word ({unit} bytes)")
        rows.append([src // unit, nbytes // unit, first])
        first += triton.cdiv(nbytes // unit, block)
    return torch.tensor(rows, dtype=torch.int64), first


def copy_experts_torch(
    source: torch.Tensor, slots: list[torch.Tensor], plan: CopyPlan, segments: torch.Tensor, *, unit: int
) -> None:
    """Reference of `copy_experts`: for every planned copy, each name's expert words into its slot."""
    source_words = source.view(_WORD[unit])
    count = int(plan.count.reshape(-1)[0])
    experts = plan.experts[: plan.stride * count : plan.stride].tolist()
    slot_ids = plan.slots[: plan.stride * count : plan.stride].tolist()
    for expert, slot in zip(experts, slot_ids, strict=True):
        for (src, words, _), tensor in zip(segments.tolist(), slots, strict=True):
            chunk = source_words[src + expert * words : src + (expert + 1) * words]
            tensor.reshape(-1).view(_WORD[unit])[slot * words : (slot + 1) * words] = chunk.to(tensor.device)


def copy_experts(
    source: torch.Tensor,
    slots: list[torch.Tensor],
    plan: CopyPlan,
    segments: torch.Tensor,
    chunks_per_expert: int,
    *,
    unit: int,
    num_experts: int,
    num_programs: int | None = None,
    block: int = DEFAULT_BLOCK,
) -> None:
    """Copy the planned experts without reading the plan on the host.

    Args:
        source: ``[bytes]`` uint8 store buffer: pinned host memory (GPU slots) or any CPU
            tensor (interpreted).
        slots: the ``[S, *shape]`` contiguous slot tensors on the device, one per row of
            ``segments`` (at most ``MAX_TENSORS``).
        plan: the copies, on the slots' device (`CopyPlan`; a pool's: ``CopyPlan.of(plan)``).
        segments: ``[names, 3]`` int64 on the device, from `build_segments` with ``block``.
        chunks_per_expert: from `build_segments`.
        unit: bytes of a copy word (4, 2 or 1).
        num_experts: rows of the store (entries outside are skipped).
        num_programs: programs of the persistent grid (fixed: graph-safe); default
            ``DEFAULT_PROGRAMS`` on a GPU, 2 when interpreted (programs run one by one there).
        block: words per chunk (a power of two).
    """
    if source.dtype != torch.uint8 or source.dim() != 1:
        raise ValueError("source must be a flat uint8 buffer")
    if not 1 <= len(slots) <= MAX_TENSORS or len(slots) != segments.shape[0]:
        raise ValueError(f"give 1 to {MAX_TENSORS} slot tensors, one per segment")
    if any(not t.is_contiguous() or t.device != slots[0].device for t in slots):
        raise ValueError("slot tensors must be contiguous and on one device")
    if not runs_on(slots[0]):
        raise RuntimeError("the copy kernel needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    word = _WORD[unit]
    if num_programs is None:
        num_programs = DEFAULT_PROGRAMS if slots[0].is_cuda else 2
    if slots[0].is_cuda and not source.is_cuda:
        if not source.is_pinned():
            raise ValueError("the source buffer must be pinned to be read by the GPU")
        source_arg: object = MappedHostPointer(source, word)
    else:
        source_arg = source.view(word)
    destinations = [t.reshape(-1).view(word) for t in slots]
    destinations += [destinations[0]] * (MAX_TENSORS - len(destinations))
    _copy_experts_kernel[(num_programs,)](
        source_arg, *destinations, plan.count, plan.experts, plan.slots, plan.stride, segments,
        num_experts, slots[0].shape[0], chunks_per_expert,
        BLOCK=block, NUM_PROGRAMS=num_programs, NUM_SEGMENTS=segments.shape[0], num_warps=warps_for(block),
    )  # fmt: skip


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
