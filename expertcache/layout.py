"""Per-expert tensor registration and the byte layout of one expert's record.

A quant method declares the tensors one expert has (name, per-expert shape, dtype); the
cache stores them as opaque bytes, one contiguous *record* per expert::

    record of expert e:  [ w1 bytes | pad | w2 bytes | pad | w1_scale bytes | pad | ... ]

so one expert moves host -> GPU in a single copy however many small tensors (scales,
biases) it has. Fields start on ``ALIGNMENT``-byte boundaries, which keeps every per-expert
matrix aligned for vectorised loads. A format the cache has never seen needs no cache code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

#: Byte alignment of every field inside a record (and of the record size).
ALIGNMENT = 256

REQUIRED = ("w1", "w2")


@dataclass(frozen=True, slots=True)
class ExpertTensorSpec:
    """One registered per-expert tensor: ``name``, ``shape`` of one expert, ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's tensor."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class RecordLayout:
    """Where each registered tensor sits inside one expert's record.

    Attributes:
        specs: the registered tensors, ``w1`` and ``w2`` first, then the rest by name.
        offsets: byte offset of each spec's field inside a record.
        record_bytes: bytes of one record (a multiple of ``ALIGNMENT``).
    """

    specs: tuple[ExpertTensorSpec, ...]
    offsets: tuple[int, ...]
    record_bytes: int

    @classmethod
    def from_specs(cls, specs: tuple[ExpertTensorSpec, ...]) -> RecordLayout:
        offsets, cursor = [], 0
        for spec in specs:
            offsets.append(cursor)
            cursor = _align(cursor + spec.nbytes)
        return cls(tuple(specs), tuple(offsets), max(cursor, ALIGNMENT))

    @property
    def payload_bytes(self) -> int:
        """Bytes of real data in one record (without alignment padding)."""
        return sum(spec.nbytes for spec in self.specs)

    def views(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views ``{name: [N, *shape]}`` into ``records`` (``[N, record_bytes]`` uint8).

        The views share memory with ``records``; each expert's tensor is contiguous.
        """
        out = {}
        for spec, offset in zip(self.specs, self.offsets, strict=True):
            field = records[:, offset : offset + spec.nbytes]
            out[spec.name] = field.view(spec.dtype).view(records.shape[0], *spec.shape)
        return out

    def check_compatible(self, other: RecordLayout, *, what: str) -> None:
        """Raise ValueError when ``other`` registers different tensors than ``self``."""
        if self.specs != other.specs:
            raise ValueError(f"{what} registers {other.specs}, but the slot pool holds {self.specs}")


def layout_from_weights(weights: Mapping[str, torch.Tensor]) -> tuple[int, RecordLayout]:
    """Validate a ``{name: [E, ...]}`` mapping and derive its record layout.

    Returns:
        ``(num_experts, layout)``.

    Raises:
        TypeError: ``weights`` is not a mapping of names to tensors.
        ValueError: ``w1`` or ``w2`` is missing, a tensor has no expert dimension, the
            tensors disagree on the number of experts, or ``w1``/``w2`` shapes disagree.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must map names to tensors, got {type(weights).__name__}")
    for name, tensor in weights.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weights must map str names to tensors; entry {name!r} is not")
        if tensor.dim() < 1:
            raise ValueError(f"weights[{name!r}] has no expert dimension (shape {tuple(tensor.shape)})")
    missing = [name for name in REQUIRED if name not in weights]
    if missing:
        raise ValueError(f"weights lacks {missing}; 'w1' [E, 2I, H] and 'w2' [E, H, I] are required")
    counts = {name: int(t.shape[0]) for name, t in weights.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"weights disagree on the number of experts (first dimension): {counts}")
    num_experts = counts["w1"]
    if num_experts < 1:
        raise ValueError("weights hold no experts (first dimension is 0)")
    _check_matrix_shapes(weights["w1"], weights["w2"])
    rest = sorted(name for name in weights if name not in REQUIRED)
    specs = tuple(
        ExpertTensorSpec(name, tuple(weights[name].shape[1:]), weights[name].dtype) for name in (*REQUIRED, *rest)
    )
    return num_experts, RecordLayout.from_specs(specs)


def _check_matrix_shapes(w1: torch.Tensor, w2: torch.Tensor) -> None:
    # Packed quantised formats (uint8 MXFP4, ...) change the last dimensions; only plain
    # floating-point matrices can be checked. Both the x @ W.T layout ([E, 2I, H], [E, H, I])
    # and the x @ W layout some hosts keep (GPT-OSS: [E, H, 2I], [E, I, H]) are accepted.
    if not (w1.is_floating_point() and w2.is_floating_point()):
        return
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1 must be [E, 2I, H] and w2 [E, H, I]; got {tuple(w1.shape)} and {tuple(w2.shape)}")
    _, a, b = w1.shape
    _, c, d = w2.shape
    transposed_w = b == 2 * c and a == d  # [E, H, 2I], [E, I, H]
    if not ((b == c and a == 2 * d) or transposed_w):
        raise ValueError(
            f"w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} disagree: expected w1 [E, 2I, H] "
            f"and w2 [E, H, I] (or the transposed [E, H, 2I] and [E, I, H])"
        )
