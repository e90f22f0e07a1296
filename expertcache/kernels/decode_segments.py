"""Where the coded names of one decoding-copy launch lie (`expertcache.kernels.decode_copy`).

A launch of the decoding copy kernel serves up to ``MAX_TENSORS`` exponent-coded names of
one code; `build_decode_segments` checks them and gives the kernel's scalars (each name's
region, its first block among an expert's blocks, the scratch one program stages a block
in), and `scratch_bytes` the scratch a launch needs.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from expertcache.exponent_code import RecordFormat

#: Coded slot tensors one launch writes (kernel arguments ``slots0 .. slots3``).
MAX_TENSORS = 4


class DecodeSegments(NamedTuple):
    """Where each of up to ``MAX_TENSORS`` coded names lives in the source, in bytes.

    Attributes:
        offsets: first byte of each name's region (a multiple of 16).
        formats: each name's `RecordFormat` (one code for all).
        first_chunks: first chunk (block) of each name among an expert's chunks.
        chunks_per_expert: blocks of one expert over all names.
        stage_words: 32-bit words of scratch one program needs (a power of two).
    """

    offsets: tuple[int, ...]
    formats: tuple[RecordFormat, ...]
    first_chunks: tuple[int, ...]
    chunks_per_expert: int
    stage_words: int


def build_decode_segments(source_offsets: tuple[int, ...], formats: tuple[RecordFormat, ...]) -> DecodeSegments:
    """The `DecodeSegments` of coded names whose regions start at ``source_offsets`` (bytes)."""
    if not 1 <= len(formats) <= MAX_TENSORS:
        raise ValueError(f"a launch decodes 1 to {MAX_TENSORS} tensors, got {len(formats)}")
    if len({fmt.code for fmt in formats}) != 1:
        raise ValueError("one launch decodes one code (dtype, code bits, second bits, block); group the names by code")
    if any(offset % 16 for offset in source_offsets) or any(fmt.values < 1 for fmt in formats):
        raise ValueError("regions must start on 16-byte boundaries and hold at least one value")
    chunks = [fmt.num_blocks for fmt in formats]
    first_chunks = tuple(sum(chunks[:index]) for index in range(len(chunks)))
    stage = triton.next_power_of_2(max(fmt.block_bytes() for fmt in formats) // 4)
    return DecodeSegments(tuple(source_offsets), tuple(formats), first_chunks, sum(chunks), stage)


def scratch_bytes(segments: DecodeSegments, num_programs: int) -> int:
    """Bytes of the scratch a launch of ``num_programs`` programs needs."""
    return num_programs * segments.stage_words * 4
