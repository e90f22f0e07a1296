"""What both passes of the exponent encoder read: the experts a step at a time, as blocks of fields.

A 16-bit value is ``sign | exponent | mantissa``: `split_fields` takes it apart into its exponent
and its *literal* (sign and mantissa), `block_bits` cuts each expert's values into blocks of
``code.block`` (zero past the last value; `valid_values` marks the real ones), and `book_index`
finds each exponent's entry in its block's codebook. The passes
(`expertcache.exponent_analysis`, `expertcache.exponent_records`) check their input
(`check_experts`, `check_progress`) and walk the experts in steps of about
``VALUES_PER_STEP`` values (`expert_steps`, which bounds the temporaries) on the encoding device
(`target_device`; `moved_to` moves one step's experts there).

These are the encoder's own names: only its two passes import them.
"""

from __future__ import annotations

import torch

from expertcache.exponent_code import ExponentCode
from expertcache.validation import is_dense, resolve_device

VALUES_PER_STEP = 1 << 24  # values encoded per vectorised step (bounds temporaries)


def block_bits(tensor: torch.Tensor, code: ExponentCode) -> torch.Tensor:
    """``[E, num_blocks, block]`` int32 bit patterns, zero past the last value."""
    flat = tensor.detach().reshape(tensor.shape[0], -1).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    pad = -flat.shape[1] % code.block
    return torch.nn.functional.pad(flat, (0, pad)).view(flat.shape[0], -1, code.block)


def split_fields(bits: torch.Tensor, code: ExponentCode) -> tuple[torch.Tensor, torch.Tensor]:
    """(exponent, literal) of each bit pattern."""
    m = code.mantissa_bits
    exponent = (bits >> m) & ((1 << code.exponent_bits) - 1)
    literal = ((bits >> 15) << m) | (bits & ((1 << m) - 1))
    return exponent, literal


def valid_values(values: int, code: ExponentCode, num_blocks: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(num_blocks * code.block, device=device) < values).view(num_blocks, code.block)


def book_index(exponent: torch.Tensor, codebooks: torch.Tensor, code: ExponentCode) -> torch.Tensor:
    """Each value's entry in its block's codebook (``code.book_size`` when it is not in it)."""
    rows = exponent.shape[0] * exponent.shape[1]
    table = torch.full((rows, 1 << code.exponent_bits), code.book_size, dtype=torch.int64, device=exponent.device)
    entries = torch.arange(code.book_size, device=exponent.device).expand(rows, -1)
    table.scatter_(1, codebooks.reshape(rows, -1), entries)
    return table.gather(1, exponent.reshape(rows, -1).long()).view(exponent.shape)


def check_progress(progress: object) -> None:
    if progress is not None and not isinstance(progress, str):
        raise TypeError(f"progress must be a str or None, got {type(progress).__name__} {progress!r:.40}")


def expert_steps(num_experts: int, values: int, progress: str | None):
    per_step = max(1, VALUES_PER_STEP // max(values, 1))
    starts = range(0, num_experts, per_step)
    if progress is not None and num_experts > per_step:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=progress, unit="step", leave=False, disable=None)  # None: on a terminal
    return ((start, min(start + per_step, num_experts)) for start in starts)


def check_experts(tensor: object, code: object) -> None:
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


def target_device(tensor: torch.Tensor, device: torch.device | str | None) -> torch.device:
    """Where the passes run: ``device``, else ``tensor``'s device (either checked, `resolve_device`)."""
    return resolve_device(tensor.device if device is None else device)


def moved_to(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """``tensor`` (a step's experts) on the encoding device: a copy of this step only."""
    return tensor.detach() if device is None else tensor.detach().to(device)
