"""`ExpertWeightResult`: what a weight provider hands to the fused-MoE kernel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class Landing(NamedTuple):
    """A pass whose copies may still be arriving (`expertcache.kernels.landing`).

    Attributes:
        counts: ``[N]`` int32 on the slots' device: slot ``s`` holds its expert once
            ``counts[s] >= target`` (read it on the device, in the kernel that reads the slot).
        target: what an expert's copies count over the layer's copy groups.
        gate_up_target, gate_up_mask: slot ``s`` holds its expert's ``w1`` (and
            ``w1_scale``) once ``counts[s] & gate_up_mask >= gate_up_target``, maybe before
            the rest (None, -1: only once it holds the whole expert).
    """

    counts: torch.Tensor
    target: int
    gate_up_target: int | None = None
    gate_up_mask: int = -1

    def gate_up(self) -> tuple[int, int]:
        """``(target, mask)`` that a kernel reading only ``w1`` (and ``w1_scale``) waits for."""
        return (self.target, -1) if self.gate_up_target is None else (self.gate_up_target, self.gate_up_mask)


@dataclass(frozen=True)
class ExpertWeightResult:
    """Expert weights for one fused-MoE call and the ids that index them.

    Attributes:
        w1: ``[N, 2I, H]`` gate rows then up rows for every expert the kernel may index.
            ``N`` is the number of slots (cached) or of local experts (fully resident).
        w2: ``[N, H, I]`` down projections, same index space as ``w1``.
        topk_ids: ``[T, K]``, same dtype as the ids given to ``prepare``: the router's ids
            remapped into the index space of ``w1``/``w2``. ``-1`` marks an expert that is
            not served here (another rank's, under expert parallelism); kernels skip it.
        w1_scale: per-expert scales of ``w1`` in the same index space, or None.
        w2_scale: per-expert scales of ``w2`` in the same index space, or None.
        extra: any other registered per-expert tensor (biases, MXFP4 scales, ...), by the
            name it was registered under, in the same index space.
        landing: None (every slot of ``topk_ids`` holds its expert once the kernel's stream
            reaches it), or, only for a caller that asked for it (``provider.passes(ids,
            overlap=True, landing=True)``), the `Landing` counters its kernel must wait on,
            per slot, before reading a slot (`expertcache.kernels.moe_apply_passes` does).

    Layout: every tensor is contiguous, so entry ``s`` of tensor ``t`` (``s < num_slots``)
    starts at ``t.data_ptr() + s * t[0].nbytes`` and kernels that index a pool by raw
    offsets (CUTLASS, Marlin, grouped GEMMs, hand-written CUDA) read the right bytes. The
    tensors of a cached provider are fixed-address slot tensors: their ``data_ptr()``
    never changes, so CUDA graphs and engines may keep them.

    Lifetime: a cached provider's result is valid until the next ``prepare`` on the same
    slot pool (any layer of a shared pool), which may overwrite the slots. Run the kernel
    that reads it (enqueue it on the same stream) before preparing again.
    """

    w1: torch.Tensor
    w2: torch.Tensor
    topk_ids: torch.Tensor
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    landing: Landing | None = None

    @property
    def num_slots(self) -> int:
        """``N``: entries in the first dimension of every tensor (slots, or local experts)."""
        return int(self.w1.shape[0])
