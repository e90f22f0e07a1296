"""Triton kernels of expertcache (``expertcache.kernels``).

Each kernel comes as a trio: a private ``@triton.jit`` kernel, a public launcher that
validates its inputs and picks the grid, and a pure-torch reference named ``*_torch``:

    remap.py         remap_topk_ids / remap_topk_ids_torch, and lookup_slots (ids -> slots, shared)
    admission.py     admit / admit_torch               device-mode LRU: plan, commit, slot ids
    commit.py        commit_plan / commit_plan_torch   host mode: apply the host's plan, slot ids
    copy_experts.py  copy_experts / copy_experts_torch plan-driven copies from mapped pinned memory
    decode_copy.py   decode_copy / decode_copy_torch   the same, decoding exponent-coded records into bf16/fp16 slots
    decode_segments.py build_decode_segments           where a decoding launch's coded names lie, its scratch
    expert_apply.py  moe_apply / moe_apply_torch       slot-indexed SiLU-gated expert MLP (GEMV, decode)
    grouped_apply.py moe_apply_grouped, moe_apply_auto the same MLP as grouped GEMMs (many tokens)
    grouped_routing.py sort_pairs_by_expert / _torch   (token, choice) pairs grouped by id into padded blocks
    quant_apply.py   moe_apply_quant / _torch           fp8 / MXFP4 / 16-bit expert MLP, dequantised in registers
    quant_grouped.py moe_apply_quant_grouped           the same as grouped GEMMs on tensor cores
    quant_passes.py  moe_apply_quant_passes            either, summed over expert-group passes
    quant_common.py  in-register fp8 / e2m1 / e8m0 decoding, activations, input checks
    slot_tables.py   SlotTables: the state the cache kernels read and write

A launcher whose kernels are long keeps them in a sibling module (``*_kernels.py``:
``copy_experts_kernels``, ``decode_copy_kernels``, ``expert_apply_kernels``,
``grouped_apply_kernels``, ``quant_apply_kernels``; ``admission_kernels`` with
``admission_victims``); ``sum_over_k.py`` is the last step every apply shares.

No kernel uses ``@triton.autotune`` (it needs a GPU driver): block sizes are chosen by the
launcher, so the kernels also run under ``TRITON_INTERPRET=1`` on a CPU.
"""

from expertcache.kernels.apply_passes import moe_apply_passes
from expertcache.kernels.expert_apply import moe_apply, moe_apply_torch
from expertcache.kernels.grouped_apply import moe_apply_grouped
from expertcache.kernels.quant_apply import moe_apply_quant, moe_apply_quant_torch
from expertcache.kernels.quant_grouped import moe_apply_quant_grouped
from expertcache.kernels.quant_passes import moe_apply_quant_passes
from expertcache.kernels.remap import remap_topk_ids, remap_topk_ids_torch

__all__ = [
    "moe_apply",
    "moe_apply_grouped",
    "moe_apply_passes",
    "moe_apply_quant",
    "moe_apply_quant_grouped",
    "moe_apply_quant_passes",
    "moe_apply_quant_torch",
    "moe_apply_torch",
    "remap_topk_ids",
    "remap_topk_ids_torch",
]
