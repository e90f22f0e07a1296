"""Lossless exponent coding of bf16 / fp16 experts: the encoder and the pure-torch decoder.

A 16-bit float is ``sign | exponent | mantissa``. Trained (and normal-initialised) weights
use few exponents (about 2.55 bits of entropy out of bf16's 8), so each value is stored as
its *literal* (sign and mantissa, kept verbatim) and a short *code* naming its exponent in
a per-block codebook. The code width is fixed, so decoding is arithmetic on known offsets,
not a variable-length parse, and the copy kernel decodes a block without reading any other
(`expertcache.kernels.decode_copy`). With ``code_bits = 3`` (the default, chosen by
measurement: ``benchmarks/compression_ratio.py``) a bf16 value takes 8 + 3 bits plus its share of the
exceptions, about 0.70 of its raw bytes.

One expert's tensor of ``n`` values is cut into blocks of ``block`` values (the last one
shorter). One block, every part starting on a 16-byte boundary::

    [ codebook: 16 B | literals: c B | codes: c x field_bits bits | exceptions: capacity B ]

* codebook: byte ``k`` is the exponent of code ``k``, for the ``2**code_bits - 1`` most
  frequent exponents of the block; code ``2**code_bits - 1`` is the *escape*.
* literals: byte ``i`` is the low 8 bits of value ``i``'s literal ``sign << m | mantissa``
  (``m`` mantissa bits: bf16's literal is exactly this byte).
* codes: a little-endian bit stream, ``field_bits`` per value: the code in the low
  ``code_bits``, then the literal's bits above 8 (none for bf16, 3 for fp16).
* exceptions: one byte per escaped value, the exponent, in value order: the ``r``-th
  escaped value of the block (``r`` = escapes before it, a prefix sum) has exception ``r``.
  ``capacity`` is the most any block of this name holds, rounded up to 16, so every block
  has the same size and block ``j`` of expert ``e`` starts at ``e * record_bytes + j *
  block_bytes`` of the name's region: no table to read before the block.

A name whose records would not be smaller than its raw bytes is stored raw (`pays`).
Every bit pattern round-trips: NaN, Inf, denormals, signed zeros are exponents like others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Compression names `expertcache.store.CPUBackingStore` accepts (``None``: raw bytes).
COMPRESSIONS = ("exponent",)

#: (exponent bits, mantissa bits) of the dtypes the code applies to.
FLOAT16_FIELDS = {torch.bfloat16: (8, 7), torch.float16: (5, 10)}

HEADER_BYTES = 16
DEFAULT_BLOCK = 8192  # values per block: ~11 KB of bf16 codes, one read of the copy kernel
DEFAULT_CODE_BITS = 3
_VALUES_PER_STEP = 1 << 24  # values encoded per vectorised step (bounds temporaries)


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass(frozen=True, slots=True)
class ExponentCode:
    """The code of one dtype: ``code_bits`` per exponent, ``block`` values per block.

    Attributes:
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        code_bits: 2 to 4; ``2**code_bits - 1`` codebook entries plus the escape.
        block: values per block, a power of two from 16 to 65536.
    """

    dtype: torch.dtype
    code_bits: int = DEFAULT_CODE_BITS
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT16_FIELDS:
            raise ValueError(f"exponent coding applies to bfloat16 and float16 tensors, not {self.dtype}")
        if self.code_bits not in (2, 3, 4):
            raise ValueError(f"code_bits must be 2, 3 or 4, got {self.code_bits!r}")
        if self.block < 16 or self.block > 65536 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two from 16 to 65536, got {self.block!r}")

    @property
    def exponent_bits(self) -> int:
        return FLOAT16_FIELDS[self.dtype][0]

    @property
    def mantissa_bits(self) -> int:
        return FLOAT16_FIELDS[self.dtype][1]

    @property
    def field_bits(self) -> int:
        """Bits per value in the code stream: the code and the literal's bits above 8."""
        return self.code_bits + self.mantissa_bits + 1 - 8

    @property
    def escape(self) -> int:
        return (1 << self.code_bits) - 1


@dataclass(frozen=True, slots=True)
class RecordFormat:
    """Where everything is in the records of one name (one record per expert).

    Attributes:
        code: the code.
        values: values of one expert's tensor (``n``).
        capacity: exception bytes every block reserves (a multiple of 16).
    """

    code: ExponentCode
    values: int
    capacity: int

    @property
    def num_blocks(self) -> int:
        return -(-self.values // self.code.block)

    def block_bytes(self, count: int | None = None) -> int:
        """Bytes of a block of ``count`` values (default: a whole block)."""
        count = self.code.block if count is None else count
        return HEADER_BYTES + _pad16(count) + self.code_bytes(count) + self.capacity

    def code_bytes(self, count: int) -> int:
        """Bytes of the code stream of a block of ``count`` values (padded to 16)."""
        return _pad16(-(-count * self.code.field_bits // 8))

    @property
    def last_values(self) -> int:
        return self.values - (self.num_blocks - 1) * self.code.block

    @property
    def record_bytes(self) -> int:
        """Bytes of one expert's record: every block, the last one shorter."""
        if self.values == 0:
            return 0
        return (self.num_blocks - 1) * self.block_bytes() + self.block_bytes(self.last_values)

    @property
    def raw_bytes(self) -> int:
        return 2 * self.values

    def pays(self) -> bool:
        """True when the records are smaller than the raw tensor."""
        return 0 < self.record_bytes < self.raw_bytes


@dataclass(frozen=True)
class Analysis:
    """The first pass over one name: its record format and every block's codebook.

    Attributes:
        format: the records' layout.
        codebooks: ``[E, num_blocks, 2**code_bits - 1]`` int64 exponents, most frequent first.
    """

    format: RecordFormat
    codebooks: torch.Tensor


def _bits(tensor: torch.Tensor, code: ExponentCode) -> torch.Tensor:
    """``[E, num_blocks, block]`` int32 bit patterns, zero past the last value."""
    flat = tensor.detach().reshape(tensor.shape[0], -1).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    pad = -flat.shape[1] % code.block
    return torch.nn.functional.pad(flat, (0, pad)).view(flat.shape[0], -1, code.block)


def _split(bits: torch.Tensor, code: ExponentCode) -> tuple[torch.Tensor, torch.Tensor]:
    """(exponent, literal) of each bit pattern."""
    m = code.mantissa_bits
    exponent = (bits >> m) & ((1 << code.exponent_bits) - 1)
    literal = ((bits >> 15) << m) | (bits & ((1 << m) - 1))
    return exponent, literal


def _valid(values: int, code: ExponentCode, num_blocks: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(num_blocks * code.block, device=device) < values).view(num_blocks, code.block)


def _codes(exponent: torch.Tensor, codebooks: torch.Tensor, code: ExponentCode) -> torch.Tensor:
    """Code of every value given its block's codebook (the escape when it is not in it)."""
    rows = exponent.shape[0] * exponent.shape[1]
    table = torch.full((rows, 1 << code.exponent_bits), code.escape, dtype=torch.int64, device=exponent.device)
    entries = torch.arange(code.escape, device=exponent.device).expand(rows, -1)
    table.scatter_(1, codebooks.reshape(rows, -1), entries)
    return table.gather(1, exponent.reshape(rows, -1).long()).view(exponent.shape)


def _steps(num_experts: int, values: int, progress: str | None):
    per_step = max(1, _VALUES_PER_STEP // max(values, 1))
    starts = range(0, num_experts, per_step)
    if progress is not None and num_experts > per_step:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=progress, unit="step", leave=False, disable=None)  # None: on a terminal
    return ((start, min(start + per_step, num_experts)) for start in starts)


def _on(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """``tensor`` (a step's experts) on the encoding device: a copy of this step only."""
    return tensor.detach() if device is None else tensor.detach().to(device)


def analyse(
    tensor: torch.Tensor, code: ExponentCode, *, progress: str | None = None, device: torch.device | str | None = None
) -> Analysis:
    """Pass 1: each block's codebook and the exception capacity of ``tensor`` ``[E, *shape]``.

    Args:
        tensor: the experts of one name, of ``code.dtype``, on any device.
        code: the code.
        progress: a label to show a tqdm progress bar under (large tensors), or None.
        device: where to compute (default: ``tensor``'s device). A CPU tensor coded on a
            GPU moves there a step (~16 M values) at a time; the result is the same bytes.

    Returns:
        The `Analysis`; its ``codebooks`` live on ``device``.
    """
    if tensor.dtype != code.dtype:
        raise ValueError(f"the code is for {code.dtype}, the tensor is {tensor.dtype}")
    target = tensor.device if device is None else torch.device(device)
    num_experts, values = int(tensor.shape[0]), tensor[0].numel() if tensor.shape[0] else 0
    if values == 0:
        return Analysis(RecordFormat(code, 0, 0), torch.zeros(num_experts, 0, code.escape, dtype=torch.int64))
    blocks = -(-values // code.block)
    valid = _valid(values, code, blocks, target).to(torch.int64)
    books, most = [], 0
    fill = torch.arange(1 << code.exponent_bits, device=target)
    for start, stop in _steps(num_experts, values, progress):
        exponent, _ = _split(_bits(_on(tensor[start:stop], target), code), code)
        counts = torch.zeros(exponent.shape[0], blocks, fill.numel(), dtype=torch.int64, device=target)
        counts.scatter_add_(2, exponent.long(), valid.expand_as(exponent).contiguous())
        # ties broken towards the smaller exponent: the same codebook on every machine
        key = counts * (1 << code.exponent_bits) + (fill.numel() - 1 - fill)
        book = key.topk(code.escape, dim=2).indices
        books.append(book)
        escaped = (_codes(exponent, book, code) == code.escape) & valid.bool()
        most = max(most, int(escaped.sum(2).max()) if escaped.numel() else 0)
    codebooks = torch.cat(books)
    return Analysis(RecordFormat(code, values, _pad16(most)), codebooks)


def _pack(fields: torch.Tensor, field_bits: int) -> torch.Tensor:
    """``[R, block]`` fields of ``field_bits`` bits -> ``[R, block * field_bits / 8]`` uint8,
    a little-endian bit stream (values grouped so a group fills whole bytes)."""
    group = 8 // math.gcd(field_bits, 8)
    rows = fields.shape[0]
    lanes = torch.arange(group, device=fields.device)
    combined = (fields.long().view(rows, -1, group) << (field_bits * lanes)).sum(2, keepdim=True)
    nbytes = group * field_bits // 8
    return ((combined >> (8 * lanes[:nbytes])) & 0xFF).to(torch.uint8).view(rows, -1)


def _blocks(tensor: torch.Tensor, codebooks: torch.Tensor, fmt: RecordFormat) -> list[torch.Tensor]:
    """The four parts of every block, each ``[E, num_blocks, part bytes]`` uint8, whole-block sized."""
    code = fmt.code
    exponent, literal = _split(_bits(tensor, code), code)
    experts, blocks = exponent.shape[:2]
    valid = _valid(fmt.values, code, blocks, exponent.device)
    codes = _codes(exponent, codebooks, code)
    escaped = (codes == code.escape) & valid
    fields = torch.where(valid, codes | ((literal >> 8) << code.code_bits), 0)
    header = torch.zeros(experts, blocks, HEADER_BYTES, dtype=torch.uint8, device=exponent.device)
    header[..., : code.escape] = codebooks.to(torch.uint8)
    stream = _pack(fields.view(experts * blocks, -1), code.field_bits).view(experts, blocks, -1)
    stream = torch.nn.functional.pad(stream, (0, fmt.code_bytes(code.block) - stream.shape[2]))
    exceptions = torch.zeros(experts, blocks, fmt.capacity, dtype=torch.uint8, device=exponent.device)
    rank = escaped.cumsum(2) - escaped.long()
    where = escaped.nonzero(as_tuple=True)
    exceptions[where[0], where[1], rank[where]] = exponent[where].to(torch.uint8)
    literals = torch.where(valid, literal & 0xFF, 0).to(torch.uint8)
    return [header, literals, stream, exceptions]


def write_records(
    tensor: torch.Tensor,
    analysis: Analysis,
    out: torch.Tensor,
    *,
    progress: str | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Pass 2: encode ``tensor`` ``[E, *shape]`` into ``out`` ``[E, record_bytes]`` uint8.

    Args:
        tensor: the experts `analyse` saw, on any device.
        analysis: its result.
        out: where the records go, on any device (the store's host buffer): only the coded
            bytes travel there, one step at a time.
        progress: a label to show a tqdm progress bar under, or None.
        device: where to compute (default: ``tensor``'s device); same bytes on every device.
    """
    fmt = analysis.format
    if out.dtype != torch.uint8 or tuple(out.shape) != (tensor.shape[0], fmt.record_bytes):
        raise ValueError(f"out must be uint8 [{tensor.shape[0]}, {fmt.record_bytes}], got {tuple(out.shape)}")
    target = tensor.device if device is None else torch.device(device)
    last = fmt.last_values
    keep = [HEADER_BYTES, _pad16(last), fmt.code_bytes(last), fmt.capacity]
    for start, stop in _steps(int(tensor.shape[0]), fmt.values, progress):
        parts = _blocks(_on(tensor[start:stop], target), analysis.codebooks[start:stop].to(target), fmt)
        whole = torch.cat([part[:, :-1] for part in parts], dim=2).flatten(1)
        tail = torch.cat([part[:, -1, :size] for part, size in zip(parts, keep, strict=True)], dim=1)
        out[start:stop].copy_(torch.cat([whole, tail], dim=1))


def encode(
    tensor: torch.Tensor, code: ExponentCode, *, device: torch.device | str | None = None
) -> tuple[RecordFormat, torch.Tensor]:
    """Both passes: ``(format, [E, record_bytes] uint8 records on the CPU)`` of ``tensor``
    ``[E, *shape]``, computed on ``device`` (default: ``tensor``'s)."""
    analysis = analyse(tensor, code, device=device)
    out = torch.empty(int(tensor.shape[0]), analysis.format.record_bytes, dtype=torch.uint8)
    write_records(tensor, analysis, out, device=device)
    return analysis.format, out


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
