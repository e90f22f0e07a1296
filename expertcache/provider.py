"""The weight-provider interface and the fully resident passthrough.

A weight provider sits between the router and the fused-MoE kernel of one layer::

    topk_ids [T, K] --prepare--> ExpertWeightResult(w1, w2, topk_ids remapped, scales, extra)

so the kernel never knows where the weights came from. A call may need more distinct
experts than a cache holds at once (a prefill, a large batch): ``passes`` serves it as
several results, each marking the other passes' ids -1, and the engine sums its kernel's
outputs over them (`expertcache.passes`)::

    out = sum(fused_moe(hidden, r.w1, r.w2, topk_weights, r.topk_ids) for r in provider.passes(topk_ids))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping

import torch

from expertcache.kernels import remap_topk_ids
from expertcache.layout import layout_from_weights
from expertcache.result import ExpertWeightResult, Landing
from expertcache.stats import CacheStats
from expertcache.validation import (
    check_expert_map,
    check_flag,
    check_ids_in_range,
    check_overlap,
    check_topk_ids,
)

_NAMED = ("w1", "w2", "w1_scale", "w2_scale")


class ExpertWeightProvider(ABC):
    """Supplies one MoE layer's expert weights for each fused-MoE call."""

    @property
    def stats(self) -> CacheStats:
        """Cache counters; a provider that caches nothing reports none."""
        return CacheStats()

    @abstractmethod
    def prepare(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        """Make the weights of every expert in ``topk_ids`` available to the kernel.

        Args:
            topk_ids: ``[T, K]`` int32 or int64 global expert ids from the router.

        Returns:
            The weights and ``topk_ids`` remapped into their index space (-1 = not served
            here; the kernel skips it).
        """

    def passes(
        self, topk_ids: torch.Tensor, *, overlap: bool = False, landing: bool = False
    ) -> Iterator[ExpertWeightResult]:
        """Serve a call of any size as one or more results (``prepare`` is the one-pass case).

        Args:
            topk_ids: ``[T, K]`` int32 or int64 global expert ids from the router.
            overlap: the caller sums its kernel's outputs over passes exactly (per (token,
                choice) rows summed once, as `expertcache.kernels.moe_apply_passes`), so a
                cache may split a call to overlap its copies with compute. A provider with
                nothing to copy serves the call as usual.
            landing: the caller's kernel waits on a result's `Landing` counters before it
                reads a slot (`expertcache.kernels.landing`), so a cache may hand over a pass
                whose copies are still arriving. A provider with nothing to copy yields no
                counters (``result.landing`` None).

        Yields:
            `ExpertWeightResult` per pass; its ``topk_ids`` hold this pass's ids remapped
            and -1 for every id served by another pass. Every (token, choice) is served by
            exactly one pass. Run the kernel on a result before asking for the next one:
            the next pass may overwrite its slots.

        A provider that holds every expert yields ``prepare(topk_ids)`` once.
        """
        check_overlap(overlap)
        check_flag("landing", landing)
        return (self.prepare(topk_ids) for _ in range(1))  # prepared when first asked for, as a generator


class PassResults(Iterator[ExpertWeightResult]):
    """The passes of one call (``provider.passes(topk_ids)``), and the weight tensors every
    pass's result holds, known before the first pass runs.

    Iterate it like any iterator of `ExpertWeightResult`; ``close()`` ends the call. An apply
    (`expertcache.kernels.moe_apply_passes`) checks its inputs against ``preview()`` before
    the first pass admits or copies anything.

    Args:
        tensors: ``{name: [S, *shape]}``, the tensors each result holds (slot tensors of a
            cache; all of them, whatever the pass).
        results: the results, one a pass.
        topk_ids: the call's ``[T, K]`` ids (each result's ``topk_ids`` has their shape,
            dtype and device).
        landing: whether the call was asked for landing counters (``passes(..., landing=True)``):
            an apply that does not wait on them refuses such a call before its first pass.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        results: Iterator[ExpertWeightResult],
        *,
        topk_ids: torch.Tensor,
        landing: bool = False,
    ) -> None:
        self.tensors = tensors
        self.topk_ids = topk_ids
        self.landing = landing
        self._results = results

    def __next__(self) -> ExpertWeightResult:
        return next(self._results)

    def close(self) -> None:
        """End the call at once (a cache joins its copies; see `SlotPool.passes`)."""
        close = getattr(self._results, "close", None)
        if close is not None:
            close()

    def preview(self) -> ExpertWeightResult:
        """A result shaped like every pass's (the tensors, the call's ids unmapped): for checks
        of shapes, dtypes and devices only; no pass runs."""
        return result_from_tensors(self.tensors, self.topk_ids)


def result_from_tensors(
    tensors: Mapping[str, torch.Tensor], topk_ids: torch.Tensor, landing: Landing | None = None
) -> ExpertWeightResult:
    """Sort registered tensors into the fixed fields of `ExpertWeightResult` and ``extra``."""
    return ExpertWeightResult(
        w1=tensors["w1"],
        w2=tensors["w2"],
        topk_ids=topk_ids,
        w1_scale=tensors.get("w1_scale"),
        w2_scale=tensors.get("w2_scale"),
        extra={name: t for name, t in tensors.items() if name not in _NAMED},
        landing=landing,
    )


class FullGPUProvider(ExpertWeightProvider):
    """Every expert already resident: the default path, with nothing to copy.

    Args:
        weights: ``{name: [E, *shape]}`` on the device the kernel runs on (``w1`` and ``w2``
            required; see `CachedWeightProvider` for the names).
        expert_map: optional ``[E_global]`` int32 map global id -> local index or -1 (EP);
            ``weights`` then hold only the local experts.

    ``prepare`` never syncs. The metadata of ``topk_ids`` is checked always
    (`check_topk_ids`; ``passes`` checks when called, not when its pass is taken), their
    values only where they are read without a sync (on the CPU, outside ``torch.compile``):
    ``IndexError`` for an id outside ``[0, E_global)``, as a host-mode cache raises. Ids it
    cannot read (on a GPU, under ``torch.compile``) cost nothing without ``expert_map``: they
    reach the kernel as they are (`expertcache.kernels.moe_apply` skips an id outside
    ``[0, E)`` and can count it, ``invalid_ids``; a kernel of your own must bound-check, or
    pass the identity map to have such ids come out -1 for one remap kernel a call). Through
    a map every id outside ``[0, E_global)`` comes out -1, as a device-mode cache maps it.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], *, expert_map: torch.Tensor | None = None) -> None:
        num_experts, _ = layout_from_weights(weights)
        self.device = weights["w1"].device
        for name, tensor in weights.items():
            if tensor.device != self.device:
                raise ValueError(f"weights[{name!r}] is on {tensor.device}, w1 on {self.device}")
            if not tensor.is_contiguous():
                raise ValueError(
                    f"weights[{name!r}] is not contiguous: kernels index [E, *shape] tensors by offset "
                    f"(pass tensor.contiguous())"
                )
        self.num_experts = num_experts
        self._tensors = dict(weights)
        self._expert_map = None if expert_map is None else check_expert_map(expert_map, num_experts).to(self.device)
        self.num_global_experts = num_experts if self._expert_map is None else int(self._expert_map.numel())

    def prepare(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        self._check(topk_ids)
        return self._serve(topk_ids)

    def passes(
        self, topk_ids: torch.Tensor, *, overlap: bool = False, landing: bool = False
    ) -> Iterator[ExpertWeightResult]:
        """One pass, ``prepare(topk_ids)``, with the ids checked now (as a cache's ``passes``
        checks them); no counters whatever ``landing`` (nothing is copied)."""
        check_overlap(overlap)
        check_flag("landing", landing)
        self._check(topk_ids)
        return (self._serve(topk_ids) for _ in range(1))  # served when first asked for

    def _check(self, topk_ids: torch.Tensor) -> None:
        """Check ``topk_ids``: metadata always, values where they are read without a sync."""
        check_topk_ids(topk_ids, self.device)
        if topk_ids.device.type == "cpu" and not torch.compiler.is_compiling():
            check_ids_in_range(topk_ids, self.num_global_experts)

    def _serve(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        if self._expert_map is None:  # the default path: no kernel (ids read were in range; others are the kernel's)
            return result_from_tensors(self._tensors, topk_ids.contiguous())
        return result_from_tensors(self._tensors, remap_topk_ids(topk_ids, self._expert_map))
