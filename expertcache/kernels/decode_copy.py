"""Decoding copy kernel: planned experts' exponent-coded records host -> bf16/fp16 slots.

The sibling of `expertcache.kernels.copy_experts` for names stored with
`expertcache.compression` (one launch for up to ``MAX_TENSORS`` coded names of one code):
the same device plan (`CopyPlan`), the same persistent grid dealing (copy, block) work
round-robin, the same skip of copies naming a row or slot out of range, so it replays in a
CUDA graph. PCIe carries only the coded bytes; the slots receive the exact 16-bit words.

Each work item is one block of one name of one planned expert, in two steps:

1. *stage*: the block's bytes (codebook, literals, codes, second codes, exceptions: one
   contiguous range, at an offset known from scalars alone) are read from mapped pinned
   memory in 16-byte words, exactly as the copy kernel reads, into this program's scratch
   in device memory. One PCIe round trip per block, no dependent host read. A program
   reads its next item's block into registers before decoding the current one, so its
   PCIe reads stay in flight while it decodes.
2. *decode*: after a barrier, each value's literal, code field and exponent are gathered
   from the scratch (L1/L2): the exponent from the codebook, or for a value its code
   escapes, from its second code at its rank among the escaped (a prefix sum over the
   block), or for one that escapes too, from the exceptions at its rank among those (a
   second prefix sum). The word is stored to the slot. A second barrier keeps the next
   block's stage from overwriting a scratch still being read.

Decoding is integer work on cached bytes, so the kernel can keep pace with PCIe (the
bound a decoding copy must beat: ~55 GB/s of coded bytes on the project's H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from expertcache.exponent_code import HEADER_BYTES
from expertcache.exponent_decode import decode_records_torch
from expertcache.kernels._launch import chained, runs_on
from expertcache.kernels.copy_experts import CopyPlan, MappedHostPointer, warps_for
from expertcache.kernels.decode_segments import (  # noqa: F401 (re-exported: the launcher's arguments)
    MAX_TENSORS,
    DecodeSegments,
    build_decode_segments,
    scratch_bytes,
)

DEFAULT_PROGRAMS = 64


@triton.jit
def _locate(
    work, total, slots0, slots1, slots2, slots3, experts_ptr, slot_ids_ptr, stride,
    offset0, offset1, offset2, offset3, record0, record1, record2, record3,
    values0, values1, values2, values3, capacity0, capacity1, capacity2, capacity3,
    spill0, spill1, spill2, spill3, first1, first2, first3,
    num_experts, num_slots, chunks_per_expert,
    BLOCK: tl.constexpr, NUM_SEGMENTS: tl.constexpr, FIELD_BITS: tl.constexpr, HEADER: tl.constexpr,
):  # fmt: skip
    """Work item ``work`` (one block of one name of one planned copy): whether it is to be
    done, its slot, destination tensor and block, the name's sizes, and the block's first
    32-bit word in the source. Items past ``total``, or naming a row or slot out of range,
    are not done (their loads are masked)."""
    # bytes of a whole block before its second codes: codebook, literals, codes (16-aligned)
    WHOLE: tl.constexpr = HEADER + BLOCK + (BLOCK * FIELD_BITS // 8 + 15) // 16 * 16
    inside = work < total
    rank = work // chunks_per_expert
    chunk = work % chunks_per_expert
    expert = tl.load(experts_ptr + stride * rank, mask=inside, other=-1).to(tl.int64)
    slot = tl.load(slot_ids_ptr + stride * rank, mask=inside, other=-1).to(tl.int64)
    zero = (chunk * 0).to(tl.int64)  # int64 throughout: every branch must agree
    offset, record, values, capacity, spill, first, destination = (
        zero + offset0, zero + record0, zero + values0, zero + capacity0, zero + spill0, zero, slots0
    )  # fmt: skip
    if NUM_SEGMENTS > 1:
        if chunk >= first1:
            offset, record, values, capacity, spill, first, destination = (
                zero + offset1, zero + record1, zero + values1, zero + capacity1, zero + spill1, zero + first1, slots1
            )  # fmt: skip
    if NUM_SEGMENTS > 2:
        if chunk >= first2:
            offset, record, values, capacity, spill, first, destination = (
                zero + offset2, zero + record2, zero + values2, zero + capacity2, zero + spill2, zero + first2, slots2
            )  # fmt: skip
    if NUM_SEGMENTS > 3:
        if chunk >= first3:
            offset, record, values, capacity, spill, first, destination = (
                zero + offset3, zero + record3, zero + values3, zero + capacity3, zero + spill3, zero + first3, slots3
            )  # fmt: skip
    done = inside & (expert >= 0) & (expert < num_experts) & (slot >= 0) & (slot < num_slots)
    block = chunk - first
    base = (offset + expert * record + block * (WHOLE + spill + capacity)) // 4
    return done, slot, destination, block, values, capacity, spill, base


@triton.jit
def _block_bytes(
    done, block, values, capacity, spill, BLOCK: tl.constexpr, FIELD_BITS: tl.constexpr, HEADER: tl.constexpr
):  # fmt: skip
    """(values to decode, literal bytes, code bytes, 16-byte words to stage) of block
    ``block``: none of either for an item not to be done."""
    size = tl.minimum(values - block * BLOCK, BLOCK)  # the last block is shorter
    literal_bytes = (size + 15) // 16 * 16
    code_bytes = ((size * FIELD_BITS + 7) // 8 + 15) // 16 * 16
    staged = (HEADER + literal_bytes + code_bytes + spill + capacity) // 16
    # (counts, not a flag and-ed into the masks: the interpreter mishandles scalar & block)
    return tl.where(done, size, 0), literal_bytes, code_bytes, tl.where(done, staged, 0)


@triton.jit
def _decode_copy_kernel(
    source_ptr, scratch_ptr, slots0, slots1, slots2, slots3,
    count_ptr, experts_ptr, slot_ids_ptr, stride,
    offset0, offset1, offset2, offset3, record0, record1, record2, record3,
    values0, values1, values2, values3, capacity0, capacity1, capacity2, capacity3,
    spill0, spill1, spill2, spill3, first1, first2, first3,
    num_experts, num_slots, chunks_per_expert,
    BLOCK: tl.constexpr, STAGE: tl.constexpr, NUM_PROGRAMS: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    CODE_BITS: tl.constexpr, FIELD_BITS: tl.constexpr, SECOND_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    HEADER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # chained to the admission, as the copy kernel is
        gdc_launch_dependents()
        gdc_wait()
    ESCAPE: tl.constexpr = (1 << CODE_BITS) - 1
    SECOND_ESCAPE: tl.constexpr = (1 << SECOND_BITS) - 1
    scratch = scratch_ptr + tl.program_id(0) * (STAGE * 4)  # this program's bytes
    scratch_words = scratch.to(tl.pointer_type(tl.int32))
    count = tl.minimum(tl.load(count_ptr).to(tl.int32), num_slots)
    total = count * chunks_per_expert
    lanes = tl.arange(0, STAGE)
    # the first item's block is read before the loop; each iteration then reads the next
    # item's block into registers before decoding its own, so PCIe reads stay in flight
    # while the program decodes (offsets and sizes are multiples of 16 bytes: 16-byte loads)
    done, slot, destination, block, values, capacity, spill, base = _locate(
        tl.program_id(0), total, slots0, slots1, slots2, slots3, experts_ptr, slot_ids_ptr, stride,
        offset0, offset1, offset2, offset3, record0, record1, record2, record3,
        values0, values1, values2, values3, capacity0, capacity1, capacity2, capacity3,
        spill0, spill1, spill2, spill3, first1, first2, first3, num_experts, num_slots, chunks_per_expert,
        BLOCK, NUM_SEGMENTS, FIELD_BITS, HEADER,
    )  # fmt: skip
    size, literal_bytes, code_bytes, staged_words = _block_bytes(
        done, block, values, capacity, spill, BLOCK, FIELD_BITS, HEADER
    )  # fmt: skip
    staged = (lanes // 4) < staged_words
    source = tl.max_contiguous(tl.multiple_of(base + lanes, 4), STAGE)
    words = tl.load(source_ptr + source, mask=staged, other=0)
    for work in range(tl.program_id(0), total, NUM_PROGRAMS):
        # 1. the block into this program's scratch, for every thread of the program
        tl.store(scratch_words + lanes, words, mask=staged)
        tl.debug_barrier()
        this_slot, this_destination, this_block = slot, destination, block
        this_values, this_size, this_literal_bytes = values, size, literal_bytes
        second_at = HEADER + literal_bytes + code_bytes
        exceptions_at = second_at + spill  # ``spill``: the second codes' bytes
        # 2. the next item's block, in flight during the decode below
        done, slot, destination, block, values, capacity, spill, base = _locate(
            work + NUM_PROGRAMS, total, slots0, slots1, slots2, slots3, experts_ptr, slot_ids_ptr, stride,
            offset0, offset1, offset2, offset3, record0, record1, record2, record3,
            values0, values1, values2, values3, capacity0, capacity1, capacity2, capacity3,
            spill0, spill1, spill2, spill3, first1, first2, first3, num_experts, num_slots, chunks_per_expert,
            BLOCK, NUM_SEGMENTS, FIELD_BITS, HEADER,
        )  # fmt: skip
        size, literal_bytes, code_bytes, staged_words = _block_bytes(
            done, block, values, capacity, spill, BLOCK, FIELD_BITS, HEADER
        )  # fmt: skip
        staged = (lanes // 4) < staged_words
        source = tl.max_contiguous(tl.multiple_of(base + lanes, 4), STAGE)
        words = tl.load(source_ptr + source, mask=staged, other=0)
        # 3. decode every value of this block from the scratch
        index = tl.arange(0, BLOCK)
        valid = index < this_size
        low = tl.load(scratch + HEADER + index, mask=valid, other=0).to(tl.int32)
        bit = index * FIELD_BITS
        at = HEADER + this_literal_bytes + (bit >> 3)
        first_byte = tl.load(scratch + at, mask=valid, other=0).to(tl.int32)
        straddles = valid & ((bit & 7) + FIELD_BITS > 8)
        second_byte = tl.load(scratch + at + 1, mask=straddles, other=0).to(tl.int32)
        field = ((first_byte | (second_byte << 8)) >> (bit & 7)) & ((1 << FIELD_BITS) - 1)
        entry = field & ESCAPE  # the codebook entry, until a level escapes
        escaped = ((entry == ESCAPE) & valid).to(tl.int32)
        if SECOND_BITS > 0:
            before = tl.cumsum(escaped, 0) - escaped  # escapes before this value: its second code
            second_bit = before * SECOND_BITS
            second_byte_at = second_at + (second_bit >> 3)
            low_byte = tl.load(scratch + second_byte_at, mask=escaped != 0, other=0).to(tl.int32)
            spans = (escaped != 0) & ((second_bit & 7) + SECOND_BITS > 8)
            high_byte = tl.load(scratch + second_byte_at + 1, mask=spans, other=0).to(tl.int32)
            second = ((low_byte | (high_byte << 8)) >> (second_bit & 7)) & SECOND_ESCAPE
            entry = tl.where(escaped != 0, ESCAPE + second, entry)
            escaped = escaped * (second == SECOND_ESCAPE).to(tl.int32)
        position = tl.cumsum(escaped, 0) - escaped  # last-level escapes before it: its exception
        exponent_at = tl.where(escaped != 0, exceptions_at + position, entry)
        exponent = tl.load(scratch + exponent_at, mask=valid, other=0).to(tl.int32)
        literal = low | ((field >> CODE_BITS) << 8)
        word = ((literal >> MANTISSA_BITS) << 15) | (exponent << MANTISSA_BITS)
        word = word | (literal & ((1 << MANTISSA_BITS) - 1))
        start = this_block * BLOCK
        tl.store(this_destination + this_slot * this_values + start + index, word.to(tl.int16), mask=valid)
        tl.debug_barrier()  # every thread is done with the scratch before the next store


def default_programs(device: torch.device) -> int:
    """Programs of the persistent grid: ``DEFAULT_PROGRAMS`` on a GPU, 2 interpreted."""
    return DEFAULT_PROGRAMS if device.type == "cuda" else 2


def decode_copy_torch(
    source: torch.Tensor, slots: list[torch.Tensor], plan: CopyPlan, segments: DecodeSegments, *, num_experts: int
) -> None:
    """Reference of `decode_copy`: each planned expert's records decoded (in torch) into its slot.
    Takes what the kernel takes and refuses what it refuses (a strided slot tensor was left
    unwritten: its reshape was a copy)."""
    _check_arguments(source, slots, plan, segments, num_experts)
    num_slots = slots[0].shape[0]
    count = min(int(plan.num_copies.reshape(-1)[0]), num_slots)
    experts = plan.experts[: plan.stride * count : plan.stride].tolist()
    slot_ids = plan.slots[: plan.stride * count : plan.stride].tolist()
    for expert, slot in zip(experts, slot_ids, strict=True):
        if not (0 <= expert < num_experts and 0 <= slot < num_slots):
            continue
        for offset, fmt, tensor in zip(segments.offsets, segments.formats, slots, strict=True):
            start = offset + expert * fmt.record_bytes
            record = source[start : start + fmt.record_bytes].view(1, -1)
            tensor.reshape(tensor.shape[0], -1)[slot] = decode_records_torch(record, fmt)[0].to(tensor.device)


def _check_arguments(source: object, slots: object, plan: object, segments: object, num_experts: object) -> None:
    """Raise unless the launch reads only ``source``'s bytes and writes only the slots' (see `decode_copy`)."""
    if not isinstance(source, torch.Tensor):
        raise TypeError(f"source must be a tensor, got {type(source).__name__}")
    if not isinstance(slots, list | tuple) or not all(isinstance(t, torch.Tensor) for t in slots):
        bad = type(slots).__name__ if not isinstance(slots, list | tuple) else type(slots[0]).__name__
        raise TypeError(f"slots must be a list of tensors, got {bad}")
    if not isinstance(plan, CopyPlan):
        raise TypeError(f"plan must be a CopyPlan, got {type(plan).__name__}")
    if not isinstance(segments, DecodeSegments):
        raise TypeError(f"segments must be DecodeSegments, got {type(segments).__name__}")
    if type(num_experts) is not int:
        raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__} {num_experts!r:.40}")
    if num_experts < 0:
        raise ValueError(f"num_experts must be at least 0, got {num_experts}")
    if source.dtype != torch.uint8 or source.dim() != 1:
        raise ValueError("source must be a flat uint8 buffer")
    if not source.is_contiguous() or source.data_ptr() % 16 or source.numel() % 16:
        raise ValueError(
            "source must be a contiguous flat uint8 buffer on a 16-byte boundary, a multiple of 16 bytes long "
            f"(the kernel reads 16-byte words), got {source.numel()} bytes at stride {source.stride(0)}"
        )
    formats = segments.formats
    if not len(segments.offsets) == len(formats) == len(segments.first_chunks) >= 1:
        raise ValueError("segments must hold one offset and first chunk per format (build_decode_segments)")
    if len(slots) != len(formats):
        raise ValueError(f"give one slot tensor per segment ({len(formats)}), got {len(slots)}")
    needed = max(offset + num_experts * fmt.record_bytes for offset, fmt in zip(segments.offsets, formats, strict=True))
    if source.numel() < needed:
        raise ValueError(f"source holds {source.numel()} bytes; {num_experts} experts of the segments need {needed}")
    code = formats[0].code
    for tensor, fmt in zip(slots, formats, strict=True):
        if not tensor.is_contiguous() or tensor.device != slots[0].device or tensor.dtype != code.dtype:
            raise ValueError(f"slot tensors must be contiguous {code.dtype} tensors on one device")
        if tensor.dim() < 1 or tensor.shape[0] < 1:
            raise ValueError(f"slot tensors must hold at least one slot, got shape {list(tensor.shape)}")
        if tensor[0].numel() != fmt.values:
            raise ValueError(f"a slot of {tensor[0].numel()} values cannot take records of {fmt.values}")
    counts = [int(tensor.shape[0]) for tensor in slots]
    if len(set(counts)) != 1:  # slot ids are checked against one count: a smaller tensor was written past
        raise ValueError(f"slot tensors must all hold {counts[0]} slots, got {counts}")


def decode_copy(
    source: torch.Tensor,
    slots: list[torch.Tensor],
    plan: CopyPlan,
    segments: DecodeSegments,
    *,
    num_experts: int,
    scratch: torch.Tensor | None = None,
    num_programs: int | None = None,
) -> None:
    """Decode the planned experts' records into their slots without reading the plan on the host.

    Args:
        source: ``[bytes]`` uint8 store buffer: pinned host memory (GPU slots) or any CPU
            tensor (interpreted).
        slots: the ``[S, *shape]`` contiguous bf16/fp16 slot tensors on the device, one per
            name of ``segments`` (their dtype the code's).
        plan: the copies, on the slots' device (`CopyPlan`).
        segments: from `build_decode_segments`.
        num_experts: rows of the store (copies naming others are skipped).
        scratch: uint8 device buffer of at least `scratch_bytes` (keep one to make the
            launch allocation-free, e.g. inside a CUDA graph); allocated when None.
        num_programs: programs of the persistent grid (fixed: graph-safe); default
            `default_programs`.
    """
    _check_arguments(source, slots, plan, segments, num_experts)
    if num_programs is not None and type(num_programs) is not int:
        raise TypeError(f"num_programs must be an int or None, got {type(num_programs).__name__} {num_programs!r:.40}")
    if num_programs is not None and num_programs < 1:
        raise ValueError(f"num_programs must be at least 1, got {num_programs}")
    num_programs = default_programs(slots[0].device) if num_programs is None else num_programs
    needed = scratch_bytes(segments, num_programs)
    if scratch is not None and (
        not isinstance(scratch, torch.Tensor)
        or scratch.dtype != torch.uint8
        or not scratch.is_contiguous()
        or scratch.numel() < needed
        or scratch.device != slots[0].device
    ):
        raise ValueError(f"scratch must be a contiguous uint8 buffer of >= {needed} bytes on the slots' device")
    if not runs_on(slots[0]):
        raise RuntimeError("the decode kernel needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    if scratch is None:
        scratch = torch.empty(needed, dtype=torch.uint8, device=slots[0].device)
    if slots[0].is_cuda and not source.is_cuda:
        if not source.is_pinned():
            raise ValueError("the source buffer must be pinned to be read by the GPU")
        source_arg: object = MappedHostPointer(source, torch.int32)
    else:
        source_arg = source.view(torch.int32)
    pad = MAX_TENSORS - len(slots)
    formats, code = segments.formats, segments.formats[0].code
    destinations = [t.view(torch.int16) for t in slots] + [slots[0].view(torch.int16)] * pad
    _decode_copy_kernel[(num_programs,)](
        source_arg, scratch, *destinations, plan.num_copies, plan.experts, plan.slots, plan.stride,
        *segments.offsets, *(0,) * pad, *(f.record_bytes for f in formats), *(0,) * pad,
        *(f.values for f in formats), *(0,) * pad, *(f.capacity for f in formats), *(0,) * pad,
        *(f.spill_bytes for f in formats), *(0,) * pad, *segments.first_chunks[1:], *(0,) * pad,
        num_experts, slots[0].shape[0], segments.chunks_per_expert,
        BLOCK=code.block, STAGE=segments.stage_words, NUM_PROGRAMS=num_programs, NUM_SEGMENTS=len(slots),
        CODE_BITS=code.code_bits, FIELD_BITS=code.field_bits, SECOND_BITS=code.second_bits,
        MANTISSA_BITS=code.mantissa_bits, HEADER=HEADER_BYTES,
        num_warps=warps_for(code.block), **chained(slots[0].device),
    )  # fmt: skip
