"""The decoding copy kernel that `expertcache.kernels.decode_copy.decode_copy` launches (that
module states the contract: the plan, the segments, the scratch).

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

``_locate`` finds a work item's name, slot and source bytes; ``_block_bytes`` the sizes of
its block's parts.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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
