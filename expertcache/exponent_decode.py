"""The pure-torch reference decoder of exponent-coded records (`expertcache.compression`).

Reads the block layout `expertcache.exponent_code` describes and rebuilds every bit
pattern; the copy kernel `expertcache.kernels.decode_copy` decodes the same bytes on the
GPU and is checked against this one. The store reads a coded expert back with it, and the
copy path falls back to it where the kernel does not run.
"""

from __future__ import annotations

import torch

from expertcache.exponent_code import HEADER_BYTES, RecordFormat, pad16


def _unpack(stream: torch.Tensor, count: int, field_bits: int) -> torch.Tensor:
    """``[R, bytes]`` little-endian bit stream -> ``[R, count]`` int64 fields, bit by bit."""
    bits = (stream.long().unsqueeze(2) >> torch.arange(8)) & 1
    bits = bits.flatten(1)[:, : count * field_bits].view(stream.shape[0], count, field_bits)
    return (bits << torch.arange(field_bits)).sum(2)


def _at_rank(part: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Entry ``r`` of ``part`` ``[R, size]`` for each value that is the ``r``-th ``chosen``
    one of its block (zero elsewhere)."""
    rank = chosen.cumsum(1) - chosen.long()
    # one zero past the end: a block that chose nothing gathers from something
    padded = torch.nn.functional.pad(part.long(), (0, 1))
    return torch.where(chosen, padded.gather(1, rank.clamp(max=part.shape[1])), 0)


def _decode_blocks(blocks: torch.Tensor, count: int, fmt: RecordFormat) -> torch.Tensor:
    """``[R, block bytes]`` blocks of ``count`` values each -> ``[R, count]`` int64 bit patterns."""
    code = fmt.code
    literal_at, code_at = HEADER_BYTES, HEADER_BYTES + pad16(count)
    second_at = code_at + fmt.code_bytes(count)
    exception_at = second_at + fmt.spill_bytes
    fields = _unpack(blocks[:, code_at:second_at], count, code.field_bits)
    index = fields & code.escape  # the codebook entry, until a level escapes
    literal = blocks[:, literal_at : literal_at + count].long() | ((fields >> code.code_bits) << 8)
    escaped = index == code.escape
    if code.second_bits:
        seconds = _unpack(blocks[:, second_at:exception_at], fmt.spill, code.second_bits)
        second = _at_rank(seconds, escaped)
        index = torch.where(escaped, code.escape + second, index)
        escaped = escaped & (second == code.second_escape)
    exceptions = _at_rank(blocks[:, exception_at : exception_at + fmt.capacity], escaped)
    from_book = blocks[:, : code.book_size].long().gather(1, index.clamp(max=code.book_size - 1))
    exponent = torch.where(escaped, exceptions, from_book)
    m = code.mantissa_bits
    return ((literal >> m) << 15) | (exponent << m) | (literal & ((1 << m) - 1))


def decode_records_torch(records: torch.Tensor, fmt: RecordFormat) -> torch.Tensor:
    """Reference decoder: ``[E, record_bytes]`` uint8 records -> ``[E, values]`` of ``fmt``'s dtype.

    Raises:
        ValueError: ``records`` is not uint8 ``[E, fmt.record_bytes]``.
    """
    if not isinstance(fmt, RecordFormat):
        raise TypeError(f"fmt must be a RecordFormat, got {type(fmt).__name__}")
    fmt.check_records(records, "records")
    records = records.cpu()
    if fmt.values == 0:  # experts without values (`encode` of ``[E, 0]``): records of no bytes
        return torch.empty(records.shape[0], 0, dtype=fmt.code.dtype)
    experts, full = records.shape[0], fmt.num_blocks - 1
    whole = records[:, : full * fmt.block_bytes()].reshape(experts * full, fmt.block_bytes())
    parts = [_decode_blocks(whole, fmt.code.block, fmt).view(experts, -1)]
    parts.append(_decode_blocks(records[:, full * fmt.block_bytes() :], fmt.last_values, fmt))
    bits = torch.cat(parts, dim=1)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(fmt.code.dtype)
