"""Pass 2 of the exponent encoder: one name's experts written as records.

`write_records` codes every block of every expert with the codebooks `analyse` chose
(`expertcache.exponent_analysis`) in the layout `expertcache.exponent_code` describes: the
codebook, the literals, the packed codes (`_pack`), then the second codes and the exceptions
in value order (`_in_value_order`). A tensor whose blocks escape more values than the
analysis reserves is refused before ``out`` changes (`_check_fits`).
"""

from __future__ import annotations

import math

import torch

from expertcache.exponent_analysis import Analysis
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
from expertcache.exponent_code import HEADER_BYTES, RecordFormat, pad16


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
    """Raise unless every block's escapes fit what ``fmt`` reserves (``index``: `book_index`)."""
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
    exponent, _ = split_fields(block_bits(tensor, fmt.code), fmt.code)
    valid = valid_values(fmt.values, fmt.code, exponent.shape[1], exponent.device)
    _check_fits(book_index(exponent, codebooks, fmt.code), valid, fmt)


def _blocks(tensor: torch.Tensor, codebooks: torch.Tensor, fmt: RecordFormat) -> list[torch.Tensor]:
    """The five parts of every block, each ``[E, num_blocks, part bytes]`` uint8, whole-block sized."""
    code = fmt.code
    exponent, literal = split_fields(block_bits(tensor, code), code)
    experts, blocks = exponent.shape[:2]
    valid = valid_values(fmt.values, code, blocks, exponent.device)
    index = book_index(exponent, codebooks, code)
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
    check_experts(tensor, fmt.code)
    check_progress(progress)
    experts, values = int(tensor.shape[0]), tensor[0].numel() if tensor.shape[0] else 0
    if (experts, values) != (analysis.codebooks.shape[0], fmt.values):
        raise ValueError(
            f"tensor has {experts} experts of {values} values, the analysis {analysis.codebooks.shape[0]} of "
            f"{fmt.values}: write the tensor analyse saw"
        )
    fmt.check_records(out, "out", experts)
    target = target_device(tensor, device)
    if experts == 0 or values == 0:
        return  # records of no bytes
    steps = list(expert_steps(experts, values, None))
    if len(steps) > 1:  # a tensor that does not fit fails in step 1 (as it does below), before ``out`` changes
        for start, stop in steps:
            _check_step(moved_to(tensor[start:stop], target), analysis.codebooks[start:stop].to(target), fmt)
    last = fmt.last_values
    keep = [HEADER_BYTES, pad16(last), fmt.code_bytes(last), fmt.spill_bytes, fmt.capacity]
    for start, stop in expert_steps(experts, values, progress):
        parts = _blocks(moved_to(tensor[start:stop], target), analysis.codebooks[start:stop].to(target), fmt)
        whole = torch.cat([part[:, :-1] for part in parts], dim=2).flatten(1)
        tail = torch.cat([part[:, -1, :size] for part, size in zip(parts, keep, strict=True)], dim=1)
        out[start:stop].copy_(torch.cat([whole, tail], dim=1))
