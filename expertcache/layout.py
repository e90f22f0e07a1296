"""Per-expert tensor registration, and the two ways experts are laid out in memory.

A quant method declares the tensors one expert has (name, per-expert shape, dtype); the
cache stores them as opaque bytes by name. Every tensor handed to a kernel is a contiguous
``[n, *shape]`` array: entry ``s`` of tensor ``t`` starts at ``t.data_ptr() + s * t[0].nbytes``.

* The GPU slot pool (``n = S``): one allocation per name (`ExpertLayout.allocate`), so the
  slot tensors share no storage and ``torch.compile`` can see each one mutated.
* The host store (``n = E``): one buffer carved into one region per name, pinned once::

      buffer:  [ w1: [E, 2I, H] | pad | w2: [E, H, I] | pad | w1_scale: [E, ...] | pad | ... ]

Regions start on ``ALIGNMENT``-byte boundaries (vectorised loads, and any region can be
copied in 32-bit words when its sizes allow). A format the cache has never seen needs no
cache code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from expertcache.validation import check_int, is_dense

#: Byte alignment of every region inside a buffer.
ALIGNMENT = 256

REQUIRED = ("w1", "w2")


@dataclass(frozen=True, slots=True)
class ExpertTensorSpec:
    """One registered per-expert tensor: ``name``, ``shape`` of one expert, ``dtype``.

    Raises:
        TypeError / ValueError: on construction, a name that is not a str, a shape that is
            not a sequence of ints >= 0 (numpy's too; stored as a tuple of ints, so specs
            compare equal however the shape was spelled), a dtype that is not a torch.dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"a tensor spec's name must be a str, got {type(self.name).__name__}")
        if isinstance(self.shape, (str, bytes, torch.Tensor)) or not isinstance(self.shape, Sequence):
            raise TypeError(f"spec {self.name!r}: shape must be a sequence of ints, got {self.shape!r:.40}")
        shape = tuple(check_int(f"spec {self.name!r}: shape entry", size, minimum=0) for size in self.shape)
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"spec {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r:.40}")

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's tensor."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class ExpertLayout:
    """The registered tensors of one expert and how buffers of experts are laid out.

    Attributes:
        specs: the registered tensors, ``w1`` and ``w2`` first, then the rest by name
            (`layout_from_weights`' order). Any sequence is stored as a tuple.

    Raises:
        TypeError / ValueError: on construction, specs that are not `ExpertTensorSpec`, none,
            or two of one name.
    """

    specs: tuple[ExpertTensorSpec, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.specs, Sequence) or not all(isinstance(s, ExpertTensorSpec) for s in self.specs):
            raise TypeError(f"specs must be a sequence of ExpertTensorSpec, got {self.specs!r:.60}")
        object.__setattr__(self, "specs", tuple(self.specs))
        names = [spec.name for spec in self.specs]
        if not names or len(set(names)) < len(names):
            raise ValueError(f"a layout needs at least one tensor and distinct names, got {names}")

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (every tensor): what one miss copies and one slot holds."""
        return sum(spec.nbytes for spec in self.specs)

    @property
    def copy_unit(self) -> int:
        """Largest word (4, 2 or 1 bytes) that divides every tensor's per-expert bytes."""
        return math.gcd(4, *(spec.nbytes for spec in self.specs))

    def region_offsets(self, count: int, sizes: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """Byte offset of each spec's region in a buffer of ``count`` experts.

        ``sizes``: bytes one expert of each spec takes in the buffer (default: ``spec.nbytes``;
        a compressed store's records differ, `expertcache.compression`).
        """
        offsets, cursor = [], 0
        for nbytes in sizes or tuple(spec.nbytes for spec in self.specs):
            offsets.append(cursor)
            cursor = _align(cursor + count * nbytes)
        return tuple(offsets)

    def buffer_bytes(self, count: int, sizes: tuple[int, ...] | None = None) -> int:
        """Bytes of a buffer holding ``count`` experts (regions and their alignment padding)."""
        last = sizes[-1] if sizes else self.specs[-1].nbytes
        return max(_align(self.region_offsets(count, sizes)[-1] + count * last), ALIGNMENT)

    def views(self, buffer: torch.Tensor, count: int) -> dict[str, torch.Tensor]:
        """Typed contiguous views ``{name: [count, *shape]}`` into ``buffer`` (uint8, 1-D).

        The views share memory with ``buffer``; each is contiguous.
        """
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != self.buffer_bytes(count):
            raise ValueError(f"buffer must be 1-D uint8 of {self.buffer_bytes(count)} bytes for {count} experts")
        out = {}
        for spec, offset in zip(self.specs, self.region_offsets(count), strict=True):
            region = buffer[offset : offset + count * spec.nbytes]
            out[spec.name] = region.view(spec.dtype).view(count, *spec.shape)
        return out

    def allocate(self, count: int, device: torch.device, fill: int) -> dict[str, torch.Tensor]:
        """One contiguous ``[count, *shape]`` allocation per name, every byte ``fill``."""
        out = {}
        for spec in self.specs:
            raw = torch.full((count * spec.nbytes,), fill, dtype=torch.uint8, device=device)
            out[spec.name] = raw.view(spec.dtype).view(count, *spec.shape)
        return out

    def check_compatible(self, other: ExpertLayout, *, what: str, holder: str = "the slot pool") -> None:
        """Raise ValueError when ``other`` (``what``) registers different tensors than ``self``
        (what ``holder`` holds)."""
        if self.specs != other.specs:
            raise ValueError(f"{what} registers {other.specs}, but {holder} holds {self.specs}")


def layout_from_weights(weights: Mapping[str, torch.Tensor]) -> tuple[int, ExpertLayout]:
    """Validate a ``{name: [E, ...]}`` mapping and derive its layout.

    Returns:
        ``(num_experts, layout)``.

    Raises:
        TypeError: ``weights`` is not a mapping of names to dense (strided) tensors.
        ValueError: ``w1`` or ``w2`` is missing or holds no value per expert, a tensor has
            no expert dimension or lives on the meta device, the tensors disagree on the
            number of experts, or ``w1``/``w2`` shapes disagree.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must map names to tensors, got {type(weights).__name__}")
    for name, tensor in weights.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weights must map str names to tensors; entry {name!r} is not")
        if not is_dense(tensor):
            raise TypeError(f"weights[{name!r}] must be a dense (strided) tensor, got layout {tensor.layout}")
        if tensor.dim() < 1:
            raise ValueError(f"weights[{name!r}] has no expert dimension (shape {tuple(tensor.shape)})")
        if tensor.is_meta:
            raise ValueError(f"weights[{name!r}] is on the meta device: it holds no data to cache")
    missing = [name for name in REQUIRED if name not in weights]
    if missing:
        raise ValueError(f"weights lacks {missing}; 'w1' [E, 2I, H] and 'w2' [E, H, I] are required")
    counts = {name: int(t.shape[0]) for name, t in weights.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"weights disagree on the number of experts (first dimension): {counts}")
    num_experts = counts["w1"]
    if num_experts < 1:
        raise ValueError("weights hold no experts (first dimension is 0)")
    for name in REQUIRED:  # an expert of no bytes: nothing to cache, and no manifest or plan takes it
        if math.prod(weights[name].shape[1:]) == 0:
            raise ValueError(f"weights[{name!r}] holds no value per expert (shape {tuple(weights[name].shape)})")
    _check_matrix_shapes(weights["w1"], weights["w2"])
    rest = sorted(name for name in weights if name not in REQUIRED)
    specs = tuple(
        ExpertTensorSpec(name, tuple(weights[name].shape[1:]), weights[name].dtype) for name in (*REQUIRED, *rest)
    )
    return num_experts, ExpertLayout(specs)


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
