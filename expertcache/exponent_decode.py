"""The pure-torch reference decoder of exponent-coded records (`expertcache.compression`).

Reads the block layout `expertcache.exponent_code` describes and rebuilds every bit
pattern; the copy kernel `expertcache.kernels.decode_copy` decodes the same bytes on the
GPU and is checked against this one. The store reads a coded expert back with it, and the
copy path falls back to it where the kernel does not run.
"""

from __future__ import annotations

import torch

from expertcache.exponent_code import HEADER_BYTES, RecordFormat, _pad16


def _unpack(stream: torch.Tensor, count: int, field_bits: int) -> torch.Tensor:
    """``[R, bytes]`` little-endian bit stream -> ``[R, count]`` int64 fields, bit by bit."""
    bits = (stream.long().unsqueeze(2) >> torch.arange(8)) & 1
    bits = bits.flatten(1)[:, : count * field_bits].view(stream.shape[0], count, field_bits)
    return (bits << torch.arange(field_bits)).sum(2)


def _decode_blocks(blocks: torch.Tensor, count: int, fmt: RecordFormat) -> torch.Tensor:
    """``[R, block bytes]`` blocks of ``count`` values each -> ``[R, count]`` int64 bit patterns."""
    code = fmt.code
    literal_at, code_at = HEADER_BYTES, HEADER_BYTES + _pad16(count)
    exception_at = code_at + fmt.code_bytes(count)
    fields = _unpack(blocks[:, code_at:exception_at], count, code.field_bits)
    codes = fields & code.escape
    literal = blocks[:, literal_at : literal_at + count].long() | ((fields >> code.code_bits) << 8)
    escaped = codes == code.escape
    rank = (escaped.cumsum(1) - 1).clamp(min=0)
    # one zero byte past the exceptions: a block without escapes gathers from something
    exceptions = torch.nn.functional.pad(blocks[:, exception_at : exception_at + fmt.capacity].long(), (0, 1))
    from_book = blocks[:, : code.escape].long().gather(1, codes.clamp(max=code.escape - 1))
    exponent = torch.where(escaped, exceptions.gather(1, rank.clamp(max=fmt.capacity)), from_book)
    m = code.mantissa_bits
    return ((literal >> m) << 15) | (exponent << m) | (literal & ((1 << m) - 1))


def decode_records_torch(records: torch.Tensor, fmt: RecordFormat) -> torch.Tensor:
    """Reference decoder: ``[E, record_bytes]`` uint8 records -> ``[E, values]`` of ``fmt``'s dtype."""
    records = records.cpu()
    experts, full = records.shape[0], fmt.num_blocks - 1
    whole = records[:, : full * fmt.block_bytes()].reshape(experts * full, fmt.block_bytes())
    parts = [_decode_blocks(whole, fmt.code.block, fmt).view(experts, -1)]
    parts.append(_decode_blocks(records[:, full * fmt.block_bytes() :], fmt.last_values, fmt))
    bits = torch.cat(parts, dim=1)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(fmt.code.dtype)
