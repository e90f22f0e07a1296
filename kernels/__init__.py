"""Triton kernels of expertcache, installed as ``expertcache.kernels``.

Each kernel comes as a trio: a private ``@triton.jit`` kernel, a public launcher that
validates its inputs and picks the grid, and a pure-torch reference named ``*_torch``.
No kernel uses ``@triton.autotune`` (it needs a GPU driver): block sizes are chosen by the
launcher, so the kernels also run under ``TRITON_INTERPRET=1`` on a CPU.
"""

from expertcache.kernels.expert_apply import moe_apply
from expertcache.kernels.remap import remap_topk_ids, remap_topk_ids_torch

__all__ = ["moe_apply", "remap_topk_ids", "remap_topk_ids_torch"]
