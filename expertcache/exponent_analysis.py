"""Pass 1 of the exponent encoder: each block's codebook, and the room every block reserves.

`analyse` counts the exponents of every block of one name's experts ``[E, *shape]``, keeps
the ``book_size`` most frequent as the block's codebook (ties towards the smaller exponent:
the same codebook on every machine) and finds the most second codes and exception bytes any
block needs. Its `Analysis` (the `RecordFormat` and the codebooks) is what pass 2,
`expertcache.exponent_records.write_records`, writes with: the store sizes its pinned buffer
from the analyses before a record is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertcache.exponent_blocks import (
    block_bits,
    book_index,
    check_experts,
    check_progress,
    expert_steps,
    moved_to,
    split_fields,
    target_device,
    valid_values,
)
from expertcache.exponent_code import ExponentCode, RecordFormat, pad16


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
    check_experts(tensor, code)
    check_progress(progress)
    target = target_device(tensor, device)
    num_experts, values = int(tensor.shape[0]), tensor[0].numel() if tensor.shape[0] else 0
    if values == 0:
        return Analysis(RecordFormat(code, 0, 0), torch.zeros(num_experts, 0, code.book_size, dtype=torch.int64))
    blocks = -(-values // code.block)
    valid = valid_values(values, code, blocks, target).to(torch.int64)
    books, spill, most = [], 0, 0
    fill = torch.arange(1 << code.exponent_bits, device=target)
    for start, stop in expert_steps(num_experts, values, progress):
        exponent, _ = split_fields(block_bits(moved_to(tensor[start:stop], target), code), code)
        counts = torch.zeros(exponent.shape[0], blocks, fill.numel(), dtype=torch.int64, device=target)
        counts.scatter_add_(2, exponent.long(), valid.expand_as(exponent).contiguous())
        # ties broken towards the smaller exponent: the same codebook on every machine
        key = counts * (1 << code.exponent_bits) + (fill.numel() - 1 - fill)
        book = key.topk(code.book_size, dim=2).indices
        books.append(book)
        index = book_index(exponent, book, code)
        if code.second_bits:
            spill = max(spill, int(((index >= code.escape) & valid.bool()).sum(2).max()))
        most = max(most, int(((index >= code.book_size) & valid.bool()).sum(2).max()))
    codebooks = torch.cat(books)
    return Analysis(RecordFormat(code, values, pad16(most), -(-spill // 8) * 8), codebooks)
