"""The last step every expert apply shares: ``out[t]`` = sum over k of ``part[t*K + k]``, in k order.

Each apply (`expert_apply`, `grouped_apply`, `quant_apply`, `quant_grouped`, `apply_passes`)
writes every (token, choice)'s weighted expert output into an fp32 ``part`` ``[T*K, H]``;
`launch_sum` sums it over k in k order (no atomic adds: deterministic), rounds it to the
output's dtype and adds the ids outside ``[-1, N)`` to an optional counter (checking them on the host
would need a sync). With ``PDL`` (sm_90+) the kernel launches while the down kernel runs and
waits for its ``part`` on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from expertcache.kernels._launch import chained


@triton.jit
def _sum_over_k_kernel(
    part_ptr, ids_ptr, invalid_ptr, out_ptr, hidden_size, top_k, num_rows, stride_out,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, COUNT_INVALID: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched while the down kernel runs: wait for its part
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    rows = part_ptr + token * top_k * hidden_size
    total = tl.load(rows + cols, mask=mask, other=0.0)
    for k in range(1, top_k):
        total += tl.load(rows + k * hidden_size + cols, mask=mask, other=0.0)
    tl.store(out_ptr + token * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=mask)
    if COUNT_INVALID and tl.program_id(1) == 0:
        choices = tl.arange(0, BLOCK_K)
        ids = tl.load(ids_ptr + token * top_k + choices, mask=choices < top_k, other=-1).to(tl.int64)
        bad = tl.sum(((ids < -1) | (ids >= num_rows)).to(tl.int64), axis=0)
        if bad > 0:
            tl.atomic_add(invalid_ptr, bad)


def launch_sum(
    part: torch.Tensor, ids: torch.Tensor, invalid: torch.Tensor | None, out: torch.Tensor, num_rows: int
) -> None:
    """``out[t] = sum over k of part[t*K + k]`` in k order; ids outside ``[-1, N)`` are
    added to ``invalid`` (None: not counted)."""
    tokens, top_k = ids.shape
    hidden_size = out.shape[1]
    _sum_over_k_kernel[(tokens, triton.cdiv(hidden_size, 256))](
        part, ids, invalid if invalid is not None else ids, out, hidden_size, top_k, num_rows, out.stride(0),
        BLOCK_H=256, BLOCK_K=max(2, triton.next_power_of_2(top_k)), COUNT_INVALID=invalid is not None,
        **chained(out.device),
    )  # fmt: skip
