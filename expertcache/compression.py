"""Lossless exponent coding of bf16 / fp16 experts: the encoder, and the names to import.

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

This module holds the encoder (`analyse`, then `write_records`; `encode` does both). The
code's parameters and the record layout are in `expertcache.exponent_code`, the pure-torch
decoder in `expertcache.exponent_decode`; both are re-exported here, so everything the
store and the kernels use imports from this module.

Every bit pattern round-trips: NaN, Inf, denormals, signed zeros are exponents like others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from expertcache.exponent_code import (
    DEFAULT_BLOCK,
    DEFAULT_CODE_BITS,
    DEFAULT_SECOND_BITS,
    FLOAT16_FIELDS,
    HEADER_BYTES,
    ExponentCode,
    RecordFormat,
    _pad16,
)
from expertcache.exponent_decode import decode_records_torch
from expertcache.validation import is_dense, resolve_device

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_BLOCK",
    "DEFAULT_CODE_BITS",
    "DEFAULT_SECOND_BITS",
    "FLOAT16_FIELDS",
    "HEADER_BYTES",
    "Analysis",
    "ExponentCode",
    "RecordFormat",
    "analyse",
    "decode_records_torch",
    "encode",
    "write_records",
]

#: Compression names `expertcache.store.CPUBackingStore` accepts (``None``: raw bytes).
COMPRESSIONS = ("exponent",)
_VALUES_PER_STEP = 1 << 24  # values encoded per vectorised step (bounds temporaries)


@dataclass(frozen=True)
class Analysis:
    """The first pass over one name: its record format and every block's codebook.

    Attributes:
        format: the records' layout.
        codebooks: ``[E, num_blocks, code.book_size]`` int64 exponents, most frequent first.
    """

    format: RecordFormat
    codebooks: torch.Tensor

    def __post_init__(self) -> None:
        fmt, books = self.format, self.codebooks
        if not isinstance(fmt, RecordFormat):
            raise TypeError(f"format must be a RecordFormat, got {type(fmt).__name__}")
        shape = f"[E, {fmt.num_blocks}, {fmt.code.book_size}]"
        if not isinstance(books, torch.Tensor) or books.dtype != torch.int64 or books.dim() != 3:
            raise ValueError(f"codebooks must be int64 {shape}, got {_describe(books)}")
        if tuple(books.shape[1:]) != (fmt.num_blocks, fmt.code.book_size):
            raise ValueError(f"codebooks must be int64 {shape}, got {_describe(books)}")
        top = (1 << fmt.code.exponent_bits) - 1
        if books.numel() and not bool(((books >= 0) & (books <= top)).all()):
            raise ValueError(f"codebooks must hold exponents from 0 to {top} ({fmt.code.dtype})")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__


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


def _book_index(exponent: torch.Tensor, codebooks: torch.Tensor, code: ExponentCode) -> torch.Tensor:
    """Each value's entry in its block's codebook (``code.book_size`` when it is not in it)."""
    rows = exponent.shape[0] * exponent.shape[1]
    table = torch.full((rows, 1 << code.exponent_bits), code.book_size, dtype=torch.int64, device=exponent.device)
    entries = torch.arange(code.book_size, device=exponent.device).expand(rows, -1)
    table.scatter_(1, codebooks.reshape(rows, -1), entries)
    return table.gather(1, exponent.reshape(rows, -1).long()).view(exponent.shape)


def _check_progress(progress: object) -> None:
    if progress is not None and not isinstance(progress, str):
        raise TypeError(f"progress must be a str or None, got {type(progress).__name__} {progress!r:.40}")


def _steps(num_experts: int, values: int, progress: str | None):
    per_step = max(1, _VALUES_PER_STEP // max(values, 1))
    starts = range(0, num_experts, per_step)
    if progress is not None and num_experts > per_step:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=progress, unit="step", leave=False, disable=None)  # None: on a terminal
    return ((start, min(start + per_step, num_experts)) for start in starts)


def _check_experts(tensor: object, code: object) -> None:
    """Raise unless ``tensor`` is a dense ``[E, ...]`` tensor of ``code``'s dtype."""
    if not isinstance(code, ExponentCode):
        raise TypeError(f"code must be an ExponentCode, got {type(code).__name__}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"the experts must be a tensor, got {type(tensor).__name__}")
    if not is_dense(tensor):
        raise TypeError(f"the experts must be a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.dim() < 1:
        raise ValueError("the experts must be [E, ...]; got a 0-d tensor")
    if tensor.dtype != code.dtype:
        raise ValueError(f"the code is for {code.dtype}, the tensor is {tensor.dtype}")


def _target(tensor: torch.Tensor, device: torch.device | str | None) -> torch.device:
    """Where the passes run: ``device``, else ``tensor``'s device (either checked, `resolve_device`)."""
    return resolve_device(tensor.device if device is None else device)


def _on(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """``tensor`` (a step's experts) on the encoding device: a copy of this step only."""
    return tensor.detach() if device is None else tensor.detach().to(device)


def analyse(
    tensor: torch.Tensor, code: ExponentCode, *, progress: str | None = None, device: torch.device | str | None = None
) -> Analysis:
    """Pass 1: each block's codebook, and the second codes and exception bytes every block of
    ``tensor`` ``[E, *shape]`` reserves.

    Args:
        tensor: the experts of one name, of ``code.dtype``, on any device.
        code: the code.
        progress: a label to show a tqdm progress bar under (large tensors), or None.
        device: where to compute (default: ``tensor``'s device). A CPU tensor coded on a
            GPU moves there a step (~16 M values) at a time; the result is the same bytes.

    Returns:
        The `Analysis`; its ``codebooks`` live on ``device``.
    """
    _check_experts(tensor, code)
    _check_progress(progress)
    target = _target(tensor, device)
    num_experts, values = int(tensor.shape[0]), tensor[0].numel() if tensor.shape[0] else 0
    if values == 0:
        return Analysis(RecordFormat(code, 0, 0), torch.zeros(num_experts, 0, code.book_size, dtype=torch.int64))
    blocks = -(-values // code.block)
    valid = _valid(values, code, blocks, target).to(torch.int64)
    books, spill, most = [], 0, 0
    fill = torch.arange(1 << code.exponent_bits, device=target)
    for start, stop in _steps(num_experts, values, progress):
        exponent, _ = _split(_bits(_on(tensor[start:stop], target), code), code)
        counts = torch.zeros(exponent.shape[0], blocks, fill.numel(), dtype=torch.int64, device=target)
        counts.scatter_add_(2, exponent.long(), valid.expand_as(exponent).contiguous())
        # ties broken towards the smaller exponent: the same codebook on every machine
        key = counts * (1 << code.exponent_bits) + (fill.numel() - 1 - fill)
        book = key.topk(code.book_size, dim=2).indices
        books.append(book)
        index = _book_index(exponent, book, code)
        if code.second_bits:
            spill = max(spill, int(((index >= code.escape) & valid.bool()).sum(2).max()))
        most = max(most, int(((index >= code.book_size) & valid.bool()).sum(2).max()))
    codebooks = torch.cat(books)
    return Analysis(RecordFormat(code, values, _pad16(most), -(-spill // 8) * 8), codebooks)


def _pack(fields: torch.Tensor, field_bits: int) -> torch.Tensor:
    """``[R, block]`` fields of ``field_bits`` bits -> ``[R, block * field_bits / 8]`` uint8,
    a little-endian bit stream (values grouped so a group fills whole bytes)."""
    group = 8 // math.gcd(field_bits, 8)
    rows = fields.shape[0]
    lanes = torch.arange(group, device=fields.device)
    combined = (fields.long().view(rows, -1, group) << (field_bits * lanes)).sum(2, keepdim=True)
    nbytes = group * field_bits // 8
    return ((combined >> (8 * lanes[:nbytes])) & 0xFF).to(torch.uint8).view(rows, -1)


def _in_value_order(values: torch.Tensor, chosen: torch.Tensor, size: int) -> torch.Tensor:
    """``[E, B, size]`` int64: the ``values`` of each block's ``chosen`` values, at their rank
    among them (``size`` is at least the most any block chooses)."""
    out = torch.zeros(*values.shape[:2], size, dtype=torch.int64, device=values.device)
    rank = chosen.cumsum(2) - chosen.long()
    where = chosen.nonzero(as_tuple=True)
    out[where[0], where[1], rank[where]] = values[where].long()
    return out


def _check_fits(index: torch.Tensor, valid: torch.Tensor, fmt: RecordFormat) -> None:
    """Raise unless every block's escapes fit what ``fmt`` reserves (``index``: `_book_index`)."""
    code = fmt.code
    most = int(((index >= code.book_size) & valid).sum(2).max())
    spill = int(((index >= code.escape) & valid).sum(2).max()) if code.second_bits else 0
    if most > fmt.capacity or spill > fmt.spill:
        raise ValueError(
            f"tensor does not fit the analysis: a block escapes {spill} values to second codes and {most} to "
            f"exceptions, the format reserves {fmt.spill} and {fmt.capacity}: write the tensor analyse saw"
        )


def _check_step(tensor: torch.Tensor, codebooks: torch.Tensor, fmt: RecordFormat) -> None:
    """`_check_fits` of one step's experts, without encoding them."""
    exponent, _ = _split(_bits(tensor, fmt.code), fmt.code)
    valid = _valid(fmt.values, fmt.code, exponent.shape[1], exponent.device)
    _check_fits(_book_index(exponent, codebooks, fmt.code), valid, fmt)


def _blocks(tensor: torch.Tensor, codebooks: torch.Tensor, fmt: RecordFormat) -> list[torch.Tensor]:
    """The five parts of every block, each ``[E, num_blocks, part bytes]`` uint8, whole-block sized."""
    code = fmt.code
    exponent, literal = _split(_bits(tensor, code), code)
    experts, blocks = exponent.shape[:2]
    valid = _valid(fmt.values, code, blocks, exponent.device)
    index = _book_index(exponent, codebooks, code)
    _check_fits(index, valid, fmt)
    fields = torch.where(valid, index.clamp(max=code.escape) | ((literal >> 8) << code.code_bits), 0)
    header = torch.zeros(experts, blocks, HEADER_BYTES, dtype=torch.uint8, device=exponent.device)
    header[..., : code.book_size] = codebooks.to(torch.uint8)
    stream = _pack(fields.view(experts * blocks, -1), code.field_bits).view(experts, blocks, -1)
    stream = torch.nn.functional.pad(stream, (0, fmt.code_bytes(code.block) - stream.shape[2]))
    second = torch.zeros(experts, blocks, fmt.spill_bytes, dtype=torch.uint8, device=exponent.device)
    if fmt.spill:
        codes = _in_value_order(
            (index - code.escape).clamp(0, code.second_escape), (index >= code.escape) & valid, fmt.spill
        )
        packed = _pack(codes.view(experts * blocks, -1), code.second_bits).view(experts, blocks, -1)
        second[..., : packed.shape[2]] = packed
    exceptions = _in_value_order(exponent, (index >= code.book_size) & valid, fmt.capacity).to(torch.uint8)
    literals = torch.where(valid, literal & 0xFF, 0).to(torch.uint8)
    return [header, literals, stream, second, exceptions]


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
    if not isinstance(analysis, Analysis):
        raise TypeError(f"analysis must be an Analysis, got {type(analysis).__name__}")
    fmt = analysis.format
    _check_experts(tensor, fmt.code)
    _check_progress(progress)
    experts, values = int(tensor.shape[0]), tensor[0].numel() if tensor.shape[0] else 0
    if (experts, values) != (analysis.codebooks.shape[0], fmt.values):
        raise ValueError(
            f"tensor has {experts} experts of {values} values, the analysis {analysis.codebooks.shape[0]} of "
            f"{fmt.values}: write the tensor analyse saw"
        )
    fmt.check_records(out, "out", experts)
    target = _target(tensor, device)
    if experts == 0 or values == 0:
        return  # records of no bytes
    steps = list(_steps(experts, values, None))
    if len(steps) > 1:  # a tensor that does not fit fails in step 1 (as it does below), before ``out`` changes
        for start, stop in steps:
            _check_step(_on(tensor[start:stop], target), analysis.codebooks[start:stop].to(target), fmt)
    last = fmt.last_values
    keep = [HEADER_BYTES, _pad16(last), fmt.code_bytes(last), fmt.spill_bytes, fmt.capacity]
    for start, stop in _steps(experts, values, progress):
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
