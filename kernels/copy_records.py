"""Copy kernel: move the planned experts' records host -> slots in one launch.

The copy plan stays on the device (``plan_expert[r]`` -> ``plan_slot[r]`` for
``r < plan_count``), so there is no host read in the step and the launch replays in a
CUDA graph. On a GPU the source is pinned host memory read through its mapped device
address (UVA); every registered tensor of an expert (weights, scales, biases) lives in
one contiguous record, so one launch moves them all.

Work is split into ``chunks_per_record`` chunks of ``BLOCK`` 32-bit words per record and
dealt round-robin to a fixed number of programs, which keeps enough PCIe reads in flight
to approach the copy engine's bandwidth (DESIGN.md: 46-51 GB/s with >= 16 programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertcache.kernels._launch import runs_on

# Measured on an H200 (benchmarks/README.md): 64 x 4096 is best or within 2 GB/s of the best
# grid for 1 to 32 records of 9.4 MB and 44 MB.
DEFAULT_PROGRAMS = 64
DEFAULT_BLOCK = 4096  # 32-bit words per chunk (16 KiB)


@triton.jit
def _copy_records_kernel(
    source_ptr, slots_ptr, plan_expert_ptr, plan_slot_ptr, plan_count_ptr,
    record_words, chunks_per_record,
    BLOCK: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
):  # fmt: skip
    count = tl.load(plan_count_ptr).to(tl.int32)
    for work in range(tl.program_id(0), count * chunks_per_record, NUM_PROGRAMS):
        rank = work // chunks_per_record
        chunk = work % chunks_per_record
        expert = tl.load(plan_expert_ptr + rank).to(tl.int64)
        slot = tl.load(plan_slot_ptr + rank).to(tl.int64)
        offsets = chunk * BLOCK + tl.arange(0, BLOCK)
        in_record = offsets < record_words
        words = tl.load(source_ptr + expert * record_words + offsets, mask=in_record)
        tl.store(slots_ptr + slot * record_words + offsets, words, mask=in_record)


def copy_geometry(source: torch.Tensor, slots: torch.Tensor, block: int) -> tuple[object, torch.Tensor, int, int]:
    """``(source argument, slots as int32 words, record_words, chunks_per_record)`` for a launch."""
    if source.dim() != 2 or slots.dim() != 2 or source.shape[1] != slots.shape[1]:
        raise ValueError(f"records disagree: source {tuple(source.shape)}, slots {tuple(slots.shape)}")
    if source.dtype != torch.uint8 or slots.dtype != torch.uint8 or source.shape[1] % 4:
        raise ValueError("records must be uint8 with a multiple of 4 bytes per record")
    if not runs_on(_copy_records_kernel, slots):
        raise RuntimeError("the copy kernel needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    record_words = source.shape[1] // 4
    if slots.is_cuda and not source.is_cuda:
        if not source.is_pinned():
            raise ValueError("the source records must be pinned to be read by the GPU")
        source_arg: object = MappedHostPointer(source, torch.int32)
    else:
        source_arg = source.view(torch.int32)
    return source_arg, slots.view(torch.int32), record_words, triton.cdiv(record_words, block)


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


def copy_planned_records_torch(
    source: torch.Tensor,
    slots: torch.Tensor,
    plan_expert: torch.Tensor,
    plan_slot: torch.Tensor,
    plan_count: torch.Tensor,
) -> None:
    """Reference: ``slots[plan_slot[r]] = source[plan_expert[r]]`` for ``r < plan_count``."""
    count = int(plan_count.reshape(-1)[0])
    rows = plan_expert[:count].long().to(source.device)
    slots[plan_slot[:count].long()] = source[rows].to(slots.device)


def copy_planned_records(
    source: torch.Tensor,
    slots: torch.Tensor,
    plan_expert: torch.Tensor,
    plan_slot: torch.Tensor,
    plan_count: torch.Tensor,
    *,
    num_programs: int = DEFAULT_PROGRAMS,
    block: int = DEFAULT_BLOCK,
) -> None:
    """Copy the planned records without reading the plan on the host.

    Args:
        source: ``[E, R]`` uint8 records: pinned host memory (GPU slots) or any CPU tensor
            (interpreted). ``R`` must be a multiple of 4.
        slots: ``[S, R]`` uint8 slot records on the device.
        plan_expert: ``[>=S]`` int32, source row of each planned copy.
        plan_slot: ``[>=S]`` int32, destination slot of each planned copy.
        plan_count: ``[1]`` (or 0-d) int32/int64 on the device, number of planned copies.
        num_programs: programs of the persistent grid (fixed: graph-safe).
        block: 32-bit words per chunk (a power of two).
    """
    source_arg, slot_words, record_words, chunks = copy_geometry(source, slots, block)
    _copy_records_kernel[(num_programs,)](
        source_arg, slot_words, plan_expert, plan_slot, plan_count, record_words, chunks,
        BLOCK=block, NUM_PROGRAMS=num_programs, num_warps=warps_for(block),
    )  # fmt: skip
