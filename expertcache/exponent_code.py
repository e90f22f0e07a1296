"""The exponent code's parameters and where every byte of its records lies.

Part of the lossless exponent coding of bf16 / fp16 experts (`expertcache.compression`
encodes, `expertcache.exponent_decode` is the pure-torch decoder, the copy kernel
`expertcache.kernels.decode_copy` decodes on the GPU); this module holds what they all
agree on: `ExponentCode` (the dtype, code width and block size) and `RecordFormat` (the
layout of one name's records).

One expert's tensor of ``n`` values is cut into blocks of ``block`` values (the last one
shorter). One block, every part starting on a 16-byte boundary::

    [ codebook: 16 B | literals: c B | codes: c x field_bits bits
      | second codes: spill x second_bits bits | exceptions: capacity B ]

* codebook: byte ``k`` is the block's ``k``-th most frequent exponent, for the
  ``book_size`` entries of the two levels: the first ``escape = 2**code_bits - 1`` are
  named by a code, the next ``second_escape = 2**second_bits - 1`` by a second code.
* literals: byte ``i`` is the low 8 bits of value ``i``'s literal ``sign << m | mantissa``
  (``m`` mantissa bits: bf16's literal is exactly this byte).
* codes: a little-endian bit stream, ``field_bits`` per value: the code in the low
  ``code_bits``, then the literal's bits above 8 (none for bf16, 3 for fp16). Code ``k <
  escape`` names codebook entry ``k``; ``escape`` sends the value to the second level.
* second codes (absent when ``second_bits`` is 0): a little-endian stream of
  ``second_bits`` per escaped value, in value order: the ``r``-th escaped value (``r`` =
  escapes before it, a prefix sum) has second code ``r``. Code ``j < second_escape`` names
  codebook entry ``escape + j``; ``second_escape`` escapes to the exceptions.
* exceptions: one byte per value escaped from the last level, the exponent, in value
  order, at its rank among those values (a second prefix sum).
* ``spill`` (second codes) and ``capacity`` (exception bytes) are the most any block of this
  name needs, rounded up (to 8 values, to 16 bytes), so every block has the same size and
  block ``j`` of expert ``e`` starts at ``e * record_bytes + j * block_bytes`` of the name's
  region: no table to read before the block.

With one level (``second_bits = 0``) a normal-weight bf16 value takes 8 + 3 bits plus
~2% exceptions (0.70 of its bytes); with the default two levels (2 + 3 bits) 8 + 2 bits,
3 more for the ~27% the first level escapes, and ~0.4% exceptions: 0.68, near the
exponent's entropy (2.55 bits: 0.66). ``benchmarks/compression_ratio.py`` measures both.

A name whose records would not be smaller than its raw bytes is stored raw (`pays`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: (exponent bits, mantissa bits) of the dtypes the code applies to.
FLOAT16_FIELDS = {torch.bfloat16: (8, 7), torch.float16: (5, 10)}

HEADER_BYTES = 16
DEFAULT_BLOCK = 8192  # values per block: ~11 KB of bf16 codes, one read of the copy kernel
DEFAULT_CODE_BITS = 2
DEFAULT_SECOND_BITS = 3


def pad16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass(frozen=True, slots=True)
class ExponentCode:
    """The code of one dtype: ``code_bits`` per exponent (then ``second_bits`` for the escaped
    ones, when not 0), ``block`` values per block.

    Attributes:
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        code_bits: 2 to 4; ``2**code_bits - 1`` codebook entries plus the escape.
        block: values per block, a power of two from 16 to 65536.
        second_bits: keyword-only; 0 (one level) or 2 or 3: ``2**second_bits - 1`` further
            entries plus the escape to the exceptions. Both levels' entries must fit the
            16-byte codebook, so ``code_bits=4`` needs ``second_bits=0``. The one-level code
            of earlier versions is ``ExponentCode(dtype, 3, second_bits=0)``.
    """

    dtype: torch.dtype
    code_bits: int = DEFAULT_CODE_BITS
    block: int = DEFAULT_BLOCK
    second_bits: int = field(default=DEFAULT_SECOND_BITS, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(self.dtype).__name__} {self.dtype!r:.40}")
        if self.dtype not in FLOAT16_FIELDS:
            raise ValueError(f"exponent coding applies to bfloat16 and float16 tensors, not {self.dtype}")
        for name in ("code_bits", "block", "second_bits"):
            value = getattr(self, name)
            if type(value) is not int:  # not a bool (False would pass as 0), float or string
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if self.code_bits not in (2, 3, 4):
            raise ValueError(f"code_bits must be 2, 3 or 4, got {self.code_bits!r}")
        if self.block < 16 or self.block > 65536 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two from 16 to 65536, got {self.block!r}")
        if self.second_bits not in (0, 2, 3):
            raise ValueError(f"second_bits must be 0, 2 or 3, got {self.second_bits!r}")
        if self.book_size > HEADER_BYTES:
            raise ValueError(
                f"code_bits {self.code_bits} and second_bits {self.second_bits} name {self.book_size} exponents; "
                f"the codebook holds {HEADER_BYTES} (code_bits 4 takes second_bits=0)"
            )

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
        """The first level's escape code, and the number of entries it names."""
        return (1 << self.code_bits) - 1

    @property
    def second_escape(self) -> int:
        """The second level's escape code, and the number of entries it names (0: no level)."""
        return (1 << self.second_bits) - 1 if self.second_bits else 0

    @property
    def book_size(self) -> int:
        """Codebook entries of both levels."""
        return self.escape + self.second_escape


@dataclass(frozen=True, slots=True)
class RecordFormat:
    """Where everything is in the records of one name (one record per expert).

    Attributes:
        code: the code.
        values: values of one expert's tensor (``n``).
        capacity: exception bytes every block reserves (a multiple of 16).
        spill: second codes every block reserves (a multiple of 8; 0 with one level).
    """

    code: ExponentCode
    values: int
    capacity: int
    spill: int = 0

    def __post_init__(self) -> None:
        """Refuse fields no encoder writes: the kernel reads blocks at offsets made of them."""
        if not isinstance(self.code, ExponentCode):
            raise TypeError(f"code must be an ExponentCode, got {type(self.code).__name__}")
        for name in ("values", "capacity", "spill"):
            value = getattr(self, name)
            if type(value) is not int:  # not a bool, float or string
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
        if self.values < 0:
            raise ValueError(f"values must be at least 0, got {self.values}")
        block = self.code.block  # at most every value of a block escapes
        if self.capacity % 16 or not 0 <= self.capacity <= block:
            raise ValueError(f"capacity must be a multiple of 16 from 0 to {block}, got {self.capacity}")
        if self.code.second_bits == 0 and self.spill:
            raise ValueError(f"spill must be 0 for a code of one level (second_bits 0), got {self.spill}")
        if self.spill % 8 or not 0 <= self.spill <= block:
            raise ValueError(f"spill must be a multiple of 8 from 0 to {block}, got {self.spill}")

    @property
    def num_blocks(self) -> int:
        return -(-self.values // self.code.block)

    def block_bytes(self, count: int | None = None) -> int:
        """Bytes of a block of ``count`` values (default: a whole block)."""
        count = self.code.block if count is None else count
        return HEADER_BYTES + pad16(count) + self.code_bytes(count) + self.spill_bytes + self.capacity

    @property
    def spill_bytes(self) -> int:
        """Bytes of a block's second-code stream (padded to 16)."""
        return pad16(self.spill * self.code.second_bits // 8)

    def code_bytes(self, count: int) -> int:
        """Bytes of the code stream of a block of ``count`` values (padded to 16)."""
        return pad16(-(-count * self.code.field_bits // 8))

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

    def check_records(self, records: torch.Tensor, name: str, experts: int | None = None) -> None:
        """Raise ValueError unless ``records`` is uint8 ``[experts, record_bytes]`` (any number
        of experts when ``experts`` is None); TypeError unless it is a tensor."""
        if not isinstance(records, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(records).__name__}")
        rows = records.shape[0] if records.dim() == 2 and experts is None else experts
        if records.dtype != torch.uint8 or tuple(records.shape) != (rows, self.record_bytes):
            raise ValueError(
                f"{name} must be uint8 [{'E' if experts is None else experts}, {self.record_bytes}] "
                f"(record_bytes), got {records.dtype} {list(records.shape)}"
            )

    def pays(self) -> bool:
        """True when the records are smaller than the raw tensor."""
        return 0 < self.record_bytes < self.raw_bytes
