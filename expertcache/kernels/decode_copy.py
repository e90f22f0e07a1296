"""Decoding copy kernel: planned experts' exponent-coded records host -> bf16/fp16 slots.

The sibling of `expertcache.kernels.copy_experts` for names stored with
`expertcache.compression` (one launch for up to ``MAX_TENSORS`` coded names of one code):
the same device plan (`CopyPlan`), the same persistent grid dealing (copy, block) work
round-robin, the same skip of copies naming a row or slot out of range, so it replays in a
CUDA graph. PCIe carries only the coded bytes; the slots receive the exact 16-bit words.

Each program stages one block at a time into its scratch in device memory and decodes it
from there (`expertcache.kernels.decode_copy_kernels` says how). Decoding is integer work on
cached bytes, so the kernel can keep pace with PCIe (the bound a decoding copy must beat:
~55 GB/s of coded bytes on the project's H200).

This module owns the launcher (`decode_copy`: its checks, the scratch, the grid) and its
reference (`decode_copy_torch`); where a launch's names lie is `expertcache.kernels.decode_segments`.
"""

from __future__ import annotations

import torch

from expertcache.exponent_code import HEADER_BYTES
from expertcache.exponent_decode import decode_records_torch
from expertcache.kernels._launch import chained, runs_on
from expertcache.kernels.copy_experts import CopyPlan, MappedHostPointer, warps_for
from expertcache.kernels.decode_copy_kernels import _decode_copy_kernel
from expertcache.kernels.decode_segments import (  # noqa: F401 (re-exported: the launcher's arguments)
    MAX_TENSORS,
    DecodeSegments,
    build_decode_segments,
    scratch_bytes,
)

DEFAULT_PROGRAMS = 64


def default_programs(device: torch.device) -> int:
    """Programs of the persistent grid: ``DEFAULT_PROGRAMS`` on a GPU, 2 interpreted."""
    return DEFAULT_PROGRAMS if device.type == "cuda" else 2


def decode_copy_torch(
    source: torch.Tensor, slots: list[torch.Tensor], plan: CopyPlan, segments: DecodeSegments, *, num_experts: int
) -> None:
    """Reference of `decode_copy`: each planned expert's records decoded (in torch) into its slot.
    Takes what the kernel takes and refuses what it refuses (a strided slot tensor was left
    unwritten: its reshape was a copy)."""
    _check_arguments(source, slots, plan, segments, num_experts)
    num_slots = slots[0].shape[0]
    count = min(int(plan.num_copies.reshape(-1)[0]), num_slots)
    experts = plan.experts[: plan.stride * count : plan.stride].tolist()
    slot_ids = plan.slots[: plan.stride * count : plan.stride].tolist()
    for expert, slot in zip(experts, slot_ids, strict=True):
        if not (0 <= expert < num_experts and 0 <= slot < num_slots):
            continue
        for offset, fmt, tensor in zip(segments.offsets, segments.formats, slots, strict=True):
            start = offset + expert * fmt.record_bytes
            record = source[start : start + fmt.record_bytes].view(1, -1)
            tensor.reshape(tensor.shape[0], -1)[slot] = decode_records_torch(record, fmt)[0].to(tensor.device)


def _check_arguments(source: object, slots: object, plan: object, segments: object, num_experts: object) -> None:
    """Raise unless the launch reads only ``source``'s bytes and writes only the slots' (see `decode_copy`)."""
    if not isinstance(source, torch.Tensor):
        raise TypeError(f"source must be a tensor, got {type(source).__name__}")
    if not isinstance(slots, list | tuple) or not all(isinstance(t, torch.Tensor) for t in slots):
        bad = type(slots).__name__ if not isinstance(slots, list | tuple) else type(slots[0]).__name__
        raise TypeError(f"slots must be a list of tensors, got {bad}")
    if not isinstance(plan, CopyPlan):
        raise TypeError(f"plan must be a CopyPlan, got {type(plan).__name__}")
    if not isinstance(segments, DecodeSegments):
        raise TypeError(f"segments must be DecodeSegments, got {type(segments).__name__}")
    if type(num_experts) is not int:
        raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__} {num_experts!r:.40}")
    if num_experts < 0:
        raise ValueError(f"num_experts must be at least 0, got {num_experts}")
    if source.dtype != torch.uint8 or source.dim() != 1:
        raise ValueError("source must be a flat uint8 buffer")
    if not source.is_contiguous() or source.data_ptr() % 16 or source.numel() % 16:
        raise ValueError(
            "source must be a contiguous flat uint8 buffer on a 16-byte boundary, a multiple of 16 bytes long "
            f"(the kernel reads 16-byte words), got {source.numel()} bytes at stride {source.stride(0)}"
        )
    formats = segments.formats
    if not len(segments.offsets) == len(formats) == len(segments.first_chunks) >= 1:
        raise ValueError("segments must hold one offset and first chunk per format (build_decode_segments)")
    if len(slots) != len(formats):
        raise ValueError(f"give one slot tensor per segment ({len(formats)}), got {len(slots)}")
    needed = max(offset + num_experts * fmt.record_bytes for offset, fmt in zip(segments.offsets, formats, strict=True))
    if source.numel() < needed:
        raise ValueError(f"source holds {source.numel()} bytes; {num_experts} experts of the segments need {needed}")
    code = formats[0].code
    for tensor, fmt in zip(slots, formats, strict=True):
        if not tensor.is_contiguous() or tensor.device != slots[0].device or tensor.dtype != code.dtype:
            raise ValueError(f"slot tensors must be contiguous {code.dtype} tensors on one device")
        if tensor.dim() < 1 or tensor.shape[0] < 1:
            raise ValueError(f"slot tensors must hold at least one slot, got shape {list(tensor.shape)}")
        if tensor[0].numel() != fmt.values:
            raise ValueError(f"a slot of {tensor[0].numel()} values cannot take records of {fmt.values}")
    counts = [int(tensor.shape[0]) for tensor in slots]
    if len(set(counts)) != 1:  # slot ids are checked against one count: a smaller tensor was written past
        raise ValueError(f"slot tensors must all hold {counts[0]} slots, got {counts}")


def decode_copy(
    source: torch.Tensor,
    slots: list[torch.Tensor],
    plan: CopyPlan,
    segments: DecodeSegments,
    *,
    num_experts: int,
    scratch: torch.Tensor | None = None,
    num_programs: int | None = None,
) -> None:
    """Decode the planned experts' records into their slots without reading the plan on the host.

    Args:
        source: ``[bytes]`` uint8 store buffer: pinned host memory (GPU slots) or any CPU
            tensor (interpreted).
        slots: the ``[S, *shape]`` contiguous bf16/fp16 slot tensors on the device, one per
            name of ``segments`` (their dtype the code's).
        plan: the copies, on the slots' device (`CopyPlan`).
        segments: from `build_decode_segments`.
        num_experts: rows of the store (copies naming others are skipped).
        scratch: uint8 device buffer of at least `scratch_bytes` (keep one to make the
            launch allocation-free, e.g. inside a CUDA graph); allocated when None.
        num_programs: programs of the persistent grid (fixed: graph-safe); default
            `default_programs`.
    """
    _check_arguments(source, slots, plan, segments, num_experts)
    if num_programs is not None and type(num_programs) is not int:
        raise TypeError(f"num_programs must be an int or None, got {type(num_programs).__name__} {num_programs!r:.40}")
    if num_programs is not None and num_programs < 1:
        raise ValueError(f"num_programs must be at least 1, got {num_programs}")
    num_programs = default_programs(slots[0].device) if num_programs is None else num_programs
    needed = scratch_bytes(segments, num_programs)
    if scratch is not None and (
        not isinstance(scratch, torch.Tensor)
        or scratch.dtype != torch.uint8
        or not scratch.is_contiguous()
        or scratch.numel() < needed
        or scratch.device != slots[0].device
    ):
        raise ValueError(f"scratch must be a contiguous uint8 buffer of >= {needed} bytes on the slots' device")
    if not runs_on(slots[0]):
        raise RuntimeError("the decode kernel needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    if scratch is None:
        scratch = torch.empty(needed, dtype=torch.uint8, device=slots[0].device)
    if slots[0].is_cuda and not source.is_cuda:
        if not source.is_pinned():
            raise ValueError("the source buffer must be pinned to be read by the GPU")
        source_arg: object = MappedHostPointer(source, torch.int32)
    else:
        source_arg = source.view(torch.int32)
    pad = MAX_TENSORS - len(slots)
    formats, code = segments.formats, segments.formats[0].code
    destinations = [t.view(torch.int16) for t in slots] + [slots[0].view(torch.int16)] * pad
    _decode_copy_kernel[(num_programs,)](
        source_arg, scratch, *destinations, plan.num_copies, plan.experts, plan.slots, plan.stride,
        *segments.offsets, *(0,) * pad, *(f.record_bytes for f in formats), *(0,) * pad,
        *(f.values for f in formats), *(0,) * pad, *(f.capacity for f in formats), *(0,) * pad,
        *(f.spill_bytes for f in formats), *(0,) * pad, *segments.first_chunks[1:], *(0,) * pad,
        num_experts, slots[0].shape[0], segments.chunks_per_expert,
        BLOCK=code.block, STAGE=segments.stage_words, NUM_PROGRAMS=num_programs, NUM_SEGMENTS=len(slots),
        CODE_BITS=code.code_bits, FIELD_BITS=code.field_bits, SECOND_BITS=code.second_bits,
        MANTISSA_BITS=code.mantissa_bits, HEADER=HEADER_BYTES,
        num_warps=warps_for(code.block), **chained(slots[0].device),
    )  # fmt: skip
