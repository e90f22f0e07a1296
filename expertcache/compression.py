"""Lossless exponent coding of bf16 / fp16 experts: the compression names, and `encode`.

A 16-bit float is ``sign | exponent | mantissa``. Trained (and normal-initialised) weights
use few exponents (about 2.55 bits of entropy out of bf16's 8), so each value is stored as
its *literal* (sign and mantissa, kept verbatim) and a short *code* naming its exponent in
a per-block codebook, in two levels of fixed width: ``code_bits`` name the most frequent
exponents, ``second_bits`` the next ones for the values the first level escapes (found by a
prefix sum, not a variable-length parse), a byte the rest. The copy kernel decodes a block
without reading any other (`expertcache.kernels.decode_copy`). With the default 2 + 3 bits
(chosen by measurement: ``benchmarks/compression_ratio.py``) a normal-weight bf16 value
takes about 0.68 of its raw bytes; one level of 3 bits (``ExponentCode(dtype, 3,
second_bits=0)``, the code of earlier versions) takes 0.70.

The coding lies in five modules: `expertcache.exponent_code` (the code's parameters and the
record layout), `expertcache.exponent_blocks` (how the encoder reads the experts: a step of
experts at a time, as blocks of fields), `expertcache.exponent_analysis` (pass 1, `analyse`:
every block's codebook), `expertcache.exponent_records` (pass 2, `write_records`) and
`expertcache.exponent_decode` (the pure-torch decoder). This module holds `COMPRESSIONS` and
`encode` (both passes in one call); every other name is imported from its own module.

Every bit pattern round-trips: NaN, Inf, denormals, signed zeros are exponents like others.
"""

from __future__ import annotations

import torch

from expertcache.exponent_analysis import analyse
from expertcache.exponent_code import ExponentCode, RecordFormat
from expertcache.exponent_records import write_records

#: Compression names `expertcache.store.CPUBackingStore` accepts (``None``: raw bytes).
COMPRESSIONS = ("exponent",)


def encode(
    tensor: torch.Tensor, code: ExponentCode, *, device: torch.device | str | None = None
) -> tuple[RecordFormat, torch.Tensor]:
    """Both passes: ``(format, [E, record_bytes] uint8 records on the CPU)`` of ``tensor``
    ``[E, *shape]``, computed on ``device`` (default: ``tensor``'s)."""
    analysis = analyse(tensor, code, device=device)
    out = torch.empty(int(tensor.shape[0]), analysis.format.record_bytes, dtype=torch.uint8)
    write_records(tensor, analysis, out, device=device)
    return analysis.format, out
