"""A served call's expert-group passes through the implementation the cache wraps.

``provider.passes(top_k_index)`` yields one result per pass (its slot ids, -1 for the ids of
other passes); this module runs the wrapped implementation on them and makes one output:

* an implementation that takes every pass at once (a `PassSummer` as its ``sums_passes``,
  like the project's ``expertcache_quant`` kernels, which sum every (token, choice) in k
  order after the last pass) is bit-identical at any size;
* transformers' float ``batched_mm`` and ``grouped_mm``, in a call that may take several
  passes, get every (token, choice) pair as a token of its own in each pass; each pair's row
  is taken from its pass and the rows are summed as they sum them (`pairs_in_passes`):
  ``batched_mm`` bit-identical to the uncached call, ``grouped_mm`` as close as one call;
* any other implementation runs once per pass (`run_pass`), the passes summed in fp32 and
  rounded once: close to one call, not bit-identical (each pass's output is already rounded).

A call of one pass returns the implementation's result on the slots as it is: ``batched_mm``'s
bit for bit; implementations that loop over experts (``eager``, ``grouped_mm``) meet them in
slot order instead of expert order, so a token's contributions may be added in another order
(rounding differences; on the CPU ``grouped_mm``'s fp32 rows also depend on where an
expert's group sits). transformers' implementations do not skip -1 ids: in each pass only
the tokens with an id of that pass run (eagerly; inside a CUDA graph every token runs), the
other passes' ids pointed at one of this pass's slots and weighted 0, or marked with
transformers' expert-parallel sentinel. No -1 ever reaches an implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from expertcache.integrations.transformers.slot_view import SlotView, present
from expertcache.passes import max_passes
from expertcache.result import ExpertWeightResult

if TYPE_CHECKING:
    from expertcache.integrations.transformers.dispatch import Binding


@dataclass(frozen=True)
class PassSummer:
    """Marks an experts function that takes every pass of a call at once and sums them
    exactly (one result, bit-identical to the call on the full weights): set as its
    ``sums_passes`` attribute. Functions without it run once per pass, summed here.

    Attributes:
        applies: ``applies(hidden_states)``: whether it can run on these tokens' device.
        prepare: ``prepare(view)`` on a `SlotView` of the whole pool: what ``run`` computes
            with (the slot tensors every pass reads), raising ValueError for a module it
            cannot compute; called before anything is copied.
        run: ``run(prepared, pass_ids, hidden_states, top_k_weights)``, where ``pass_ids``
            yields each pass's ``[T, K]`` slot ids (-1 for other passes); take the next only
            after this one's kernels are enqueued (its copies may overwrite the slots).
    """

    applies: Callable[[torch.Tensor], bool]
    prepare: Callable[[SlotView], object]
    run: Callable[..., torch.Tensor]


def run_call(
    binding: Binding,
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """One served call: ``[T, H]``, what the wrapped implementation returns on the full
    weights (see the module docstring for how exactly). What the implementation cannot
    compute (its ``check(view)`` or `PassSummer.prepare` raising) is refused before anything
    is copied."""
    summer = getattr(binding.inner, "sums_passes", None)
    if isinstance(summer, PassSummer) and summer.applies(hidden_states):
        prepared = summer.prepare(_pool_view(binding, module))
        passes = binding.provider.passes(top_k_index)
        return summer.run(prepared, (result.topk_ids for result in passes), hidden_states, top_k_weights)
    check = getattr(binding.inner, "check", None)
    if check is not None:
        check(_pool_view(binding, module))
    if _rows_per_pair(binding) and _may_take_passes(binding, top_k_index):
        return pairs_in_passes(binding, module, hidden_states, top_k_index, top_k_weights)
    parts = [
        run_pass(binding, module, hidden_states, result, top_k_weights)
        for result in binding.provider.passes(top_k_index)
    ]
    if len(parts) == 1:
        return parts[0]
    total = parts[0].float()
    for part in parts[1:]:
        total += part
    return total.to(parts[0].dtype)


def _rows_per_pair(binding: Binding) -> bool:
    """Whether the implementation is transformers' float ``batched_mm`` or ``grouped_mm``:
    each computes every (token, choice) row on its own (a ``[T*K]`` batch of GEMVs; a grouped
    GEMM over each expert's rows), then weights the rows and sums each token's ``K`` of them
    once, which `pairs_in_passes` can redo exactly."""
    from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward

    return binding.inner is batched_mm_experts_forward or binding.inner is grouped_mm_experts_forward


def _may_take_passes(binding: Binding, top_k_index: torch.Tensor) -> bool:
    """Whether a call of these ids can need more than one pass (from the shapes alone)."""
    provider = binding.provider
    return max_passes(top_k_index.numel(), provider.num_experts, provider.pool.share) > 1


def pairs_in_passes(
    binding: Binding,
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``batched_mm`` / ``grouped_mm`` over a call in passes, bit-identical to the uncached call.

    Each pass hands the implementation every (token, choice) pair as a token of its own with
    one choice and weight 1, so the rows come back unweighted and unrounded; the pairs of other
    passes carry transformers' expert-parallel sentinel (id ``N``): ``grouped_mm`` skips them,
    so each expert's group holds exactly its rows of the uncached call, and ``batched_mm`` runs
    them (all ``T*K`` pairs: the uncached call's batch of GEMVs) on a clamped slot. Each pair's
    row is taken from the pass that holds its expert, and the rows are weighted and summed per
    token as both do themselves (``rows * w``, ``view(T, K, H).sum(dim=1)``, cast to the hidden
    dtype), the rows first put back in the dtype their GEMMs produced (`_product_dtype`: the
    implementations return them cast to the hidden dtype, exactly). Used only for calls that
    may take several passes.
    """
    num_tokens, num_top_k = top_k_index.shape
    pair_hidden = hidden_states.repeat_interleave(num_top_k, dim=0)
    unit = torch.ones(pair_hidden.shape[0], 1, dtype=hidden_states.dtype, device=hidden_states.device)
    fixed = _fixed_shapes(hidden_states)
    rows = None
    for result in binding.provider.passes(top_k_index):
        tensors = _slot_tensors(binding, result)
        ids = result.topk_ids.reshape(-1, 1)
        served = ids >= 0
        filler = ids.max().clamp(min=0)  # adds no slot to a compacted view
        view, local = _present(binding, module, tensors, torch.where(served, ids, filler), fixed=fixed)
        view = view.with_sentinels()
        part = binding.inner(view, pair_hidden, torch.where(served, local, view.num_experts), unit)
        rows = torch.where(served, part, torch.zeros_like(part) if rows is None else rows)
    assert rows is not None  # a call takes at least one pass
    weighted = rows.to(_product_dtype(binding, hidden_states)) * top_k_weights.reshape(-1, 1)
    return weighted.view(num_tokens, num_top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _pool_view(binding: Binding, module: nn.Module) -> SlotView:
    """The module over the whole pool's slot tensors (what every pass of a call reads)."""
    pool = binding.provider.pool
    return SlotView(module, {binding.parameter_of[name]: t for name, t in pool.tensors.items()}, pool.num_slots)


def run_pass(
    binding: Binding,
    module: nn.Module,
    hidden_states: torch.Tensor,
    result: ExpertWeightResult,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The inner implementation on one pass's slots; ids of other passes contribute 0."""
    tensors = _slot_tensors(binding, result)
    ids = result.topk_ids
    served = ids >= 0
    if _fixed_shapes(hidden_states):
        # No sync: every token runs; a pass with no id at all is dropped by selection (its
        # filler slot may be free, full of NaN), never by multiplying.
        filler = ids.max().clamp(min=0)
        view, local = _present(binding, module, tensors, torch.where(served, ids, filler), fixed=True)
        part = binding.inner(view, hidden_states, local, top_k_weights * served)
        return torch.where(served.any(), part, torch.zeros_like(part))
    if bool(served.all()):
        view, local = _present(binding, module, tensors, ids, fixed=False)
        return binding.inner(view, hidden_states, local, top_k_weights)
    rows = served.any(dim=1).nonzero().squeeze(1)
    out = torch.zeros_like(hidden_states)
    if rows.numel():
        mine = ids[rows]
        filler = mine.max()  # some slot of this pass: loaded, finite
        mask = served[rows]
        view, local = _present(binding, module, tensors, torch.where(mask, mine, filler), fixed=False)
        part = binding.inner(view, hidden_states[rows], local, top_k_weights[rows] * mask)
        out = out.index_copy(0, rows, part.to(out.dtype))
    return out


def _product_dtype(binding: Binding, hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype of ``batched_mm`` / ``grouped_mm``'s expert outputs before they weight them:
    autocast's where it is on (the GEMMs run in it), else the experts' (``grouped_mm`` casts
    its input to it; ``batched_mm`` needs the two equal)."""
    device = hidden_states.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return binding.provider.pool.tensors["w1"].dtype


def _fixed_shapes(hidden_states: torch.Tensor) -> bool:
    """Inside a CUDA-graph capture: no host sync, fixed shapes. (``is_compiling`` is read too,
    though `dispatch` keeps served calls out of torch.compile: the CPU tests set it to run
    this branch without a GPU.)"""
    capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
    return capturing or torch.compiler.is_compiling()


def _slot_tensors(binding: Binding, result: ExpertWeightResult) -> dict[str, torch.Tensor]:
    """The module's parameter name -> the pass's ``[S, ...]`` slot tensor."""
    slots = {"w1": result.w1, "w2": result.w2, **result.extra}
    return {binding.parameter_of[name]: tensor for name, tensor in slots.items()}


def _present(
    binding: Binding, module: nn.Module, tensors: dict[str, torch.Tensor], ids: torch.Tensor, *, fixed: bool
) -> tuple[SlotView, torch.Tensor]:
    return present(
        module,
        tensors,
        ids,
        implementation=binding.implementation,
        num_experts=binding.provider.num_experts,
        fixed=fixed,
    )
