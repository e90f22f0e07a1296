"""The copy kernel that `expertcache.kernels.copy_experts.copy_experts` launches (that module
states the contract: the plan, the segments, the landing counts).

``_copy_experts_kernel`` takes each name's `Segments` entries as scalar arguments (no table
to load before each chunk's read, and Triton sees their alignment, so the loads from mapped
memory are 16 bytes wide). Each expert is cut into chunks of ``BLOCK`` words per name, dealt
round-robin to ``NUM_PROGRAMS`` programs, which keeps enough PCIe reads in flight to
approach the copy engine's bandwidth. With ``PDL`` (sm_90+) its programs start while the
admission runs and wait on the GPU for its plan.

With ``SIGNAL`` each program adds what the chunks it has stored into a slot count (per
name) once it moves on to another name or expert (``_count_landed``: a barrier, then a
release at GPU scope), so ``landed[slot]`` reaches the expert's target when its last byte
is in the slot.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _copy_experts_kernel(
    source_ptr, slots0, slots1, slots2, slots3, slots4, slots5, slots6, slots7,
    count_ptr, experts_ptr, slot_ids_ptr, stride,
    offset0, offset1, offset2, offset3, offset4, offset5, offset6, offset7,
    words0, words1, words2, words3, words4, words5, words6, words7,
    first1, first2, first3, first4, first5, first6, first7,
    num_experts, num_slots, chunks_per_expert, landed_ptr,
    count0, count1, count2, count3, count4, count5, count6, count7,
    BLOCK: tl.constexpr, NUM_PROGRAMS: tl.constexpr, NUM_SEGMENTS: tl.constexpr, ALIGN: tl.constexpr,
    PDL: tl.constexpr, SIGNAL: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched while the admission runs: let the apply launch, then wait for the plan
        gdc_launch_dependents()
        gdc_wait()
    count = tl.minimum(tl.load(count_ptr).to(tl.int32), num_slots)
    stored = 0  # SIGNAL: what the chunks this program stored into `filling` count, not yet counted
    filling = tl.program_id(0).to(tl.int64) * 0 - 1
    filling_segment = filling
    for work in range(tl.program_id(0), count * chunks_per_expert, NUM_PROGRAMS):
        rank = work // chunks_per_expert
        chunk = work % chunks_per_expert
        expert = tl.load(experts_ptr + stride * rank).to(tl.int64)
        slot = tl.load(slot_ids_ptr + stride * rank).to(tl.int64)
        # the segment of this chunk: the last whose first chunk it reaches (int64 throughout:
        # the arguments come as int32, int64 or constants, and every branch must agree)
        zero = (chunk * 0).to(tl.int64)
        offset, words, first, destination, counts = zero + offset0, zero + words0, zero, slots0, zero + count0
        if NUM_SEGMENTS > 1:
            if chunk >= first1:
                offset, words, first, destination = zero + offset1, zero + words1, zero + first1, slots1
                counts = zero + count1
        if NUM_SEGMENTS > 2:
            if chunk >= first2:
                offset, words, first, destination = zero + offset2, zero + words2, zero + first2, slots2
                counts = zero + count2
        if NUM_SEGMENTS > 3:
            if chunk >= first3:
                offset, words, first, destination = zero + offset3, zero + words3, zero + first3, slots3
                counts = zero + count3
        if NUM_SEGMENTS > 4:
            if chunk >= first4:
                offset, words, first, destination = zero + offset4, zero + words4, zero + first4, slots4
                counts = zero + count4
        if NUM_SEGMENTS > 5:
            if chunk >= first5:
                offset, words, first, destination = zero + offset5, zero + words5, zero + first5, slots5
                counts = zero + count5
        if NUM_SEGMENTS > 6:
            if chunk >= first6:
                offset, words, first, destination = zero + offset6, zero + words6, zero + first6, slots6
                counts = zero + count6
        if NUM_SEGMENTS > 7:
            if chunk >= first7:
                offset, words, first, destination = zero + offset7, zero + words7, zero + first7, slots7
                counts = zero + count7
        if SIGNAL:
            if (slot != filling) | (first != filling_segment):  # count the last name's chunks, all stored
                _count_landed(landed_ptr, filling, stored, num_slots)
                stored = 0
                filling = slot
                filling_segment = first
            stored += counts.to(tl.int32)  # int32, as the counter (a loop-carried value keeps its type)
        if (expert >= 0) & (expert < num_experts) & (slot >= 0) & (slot < num_slots):
            start = (chunk - first) * BLOCK
            lanes = tl.arange(0, BLOCK)
            # hinted offsets (ALIGN-aligned, contiguous) make the loads ALIGN words wide
            source = tl.max_contiguous(tl.multiple_of(offset + expert * words + start + lanes, ALIGN), BLOCK)
            target = tl.max_contiguous(tl.multiple_of(slot * words + start + lanes, ALIGN), BLOCK)
            if start + BLOCK <= words:  # a whole chunk: no mask, wide loads
                tl.store(destination + target, tl.load(source_ptr + source))
            else:  # the segment's last chunk
                mask = lanes < words - start
                tl.store(destination + target, tl.load(source_ptr + source, mask=mask), mask=mask)
    if SIGNAL:
        _count_landed(landed_ptr, filling, stored, num_slots)


@triton.jit
def _count_landed(landed_ptr, slot, stored, num_slots):
    """Add ``stored`` chunks to ``landed[slot]`` after every thread's stores (barrier, release)."""
    if (stored > 0) & (slot >= 0) & (slot < num_slots):
        tl.debug_barrier()
        tl.atomic_add(landed_ptr + slot, stored, sem="release", scope="gpu")
