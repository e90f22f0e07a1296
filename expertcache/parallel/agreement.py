"""`agree_on_call`: one all-reduce before a layer call moves any data, so that bad input on
any rank makes every rank raise a Python error, none of them having changed anything.

Without it, a rank that refused its inputs would leave the others waiting in the next
collective, and ranks whose blocks differ in size (another K, another hidden dtype) would
make gloo abort the processes. The all-reduce (MAX, int64) replaces the one that found the
step's largest token count; each rank contributes::

    refused [R]   1 at its own index when it refused its inputs (type, shape, dtype, device)
    bad ids [R]   1 at its own index when its topk_ids hold an id outside [-1, E)
    T_r           -> T_max, the gathers' block size
    K, -K         -> the largest and smallest top-k over the ranks: they must be equal
    H, -H         -> likewise the hidden size
    D, -D         -> likewise hidden's dtype (its index in `COMPUTE_DTYPES`)
    E, -E         -> likewise the partition's expert count  } the layer, not the call: ranks
    S, -S         -> likewise its scheme (index in SCHEMES) } that place experts apart would
                     compute another rank's ids, or read an id as out of range on one rank only

A refused rank contributes `_NEUTRAL` to the call's shape fields, so it never makes the
others report a mismatch of its making. The bad-id flag is computed on the device (no sync
of its own): the one host read is the reduced vector's, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from expertcache.parallel.inputs import COMPUTE_DTYPES
from expertcache.parallel.partition import SCHEMES, ExpertPartition

_NEUTRAL = -(2**62)  # loses every MAX against a real figure or its negation


@dataclass(frozen=True, slots=True)
class CallShape:
    """What one rank's accepted call brings to the gathers.

    Attributes:
        tokens: ``T_r``, rows of this rank's ``hidden`` and ``topk_ids``.
        top_k: ``K``, columns of ``topk_ids``.
        hidden_size: ``H``, columns of ``hidden``.
        dtype: ``hidden``'s dtype, one of `COMPUTE_DTYPES`.
    """

    tokens: int
    top_k: int
    hidden_size: int
    dtype: torch.dtype

    def fields(self) -> list[int]:
        code = COMPUTE_DTYPES.index(self.dtype)
        return [self.tokens, self.top_k, -self.top_k, self.hidden_size, -self.hidden_size, code, -code]


def agree_on_call(
    refusal: Exception | None,
    shape: CallShape | None,
    topk_ids: torch.Tensor | None,
    *,
    partition: ExpertPartition,
    rank: int,
    world_size: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> int:
    """Share every rank's verdict on its call; every rank of ``group`` must call it.

    Args:
        refusal: the error this rank's own checks raised, or None (then ``shape`` and
            ``topk_ids`` describe the accepted call).
        topk_ids: ``[T_r, K]`` int32/int64 ids on ``device``, range-checked here.
        partition: this rank's placement of the layer's ``E`` experts (ranks must agree).

    Returns:
        ``T_max``, the largest token count over the ranks.

    Raises:
        ``refusal`` on the rank that refused; ValueError on every other rank when any rank
        refused or the ranks disagree on the partition (E, scheme), K, H or hidden's dtype;
        IndexError on every rank when any rank's ids fall outside ``[-1, E)``.
    """
    num_experts, scheme = partition.num_experts, SCHEMES.index(partition.scheme)
    header = torch.zeros(2 * world_size + 11, dtype=torch.int64)
    if shape is None or refusal is not None:
        header[rank] = 1
        header[2 * world_size : -4] = _NEUTRAL
    else:
        header[2 * world_size : -4] = torch.tensor(shape.fields())
    header[-4:] = torch.tensor([num_experts, -num_experts, scheme, -scheme])
    header = header.to(device)
    if topk_ids is not None and refusal is None and topk_ids.numel():
        header[world_size + rank] = ((topk_ids < -1) | (topk_ids >= num_experts)).any().to(torch.int64)
    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group)
    values = header.tolist()
    if refusal is not None:
        raise refusal
    _raise_on_disagreement(values, world_size, num_experts)
    return values[2 * world_size]


def _raise_on_disagreement(values: list[int], world_size: int, num_experts: int) -> None:
    refused = [r for r in range(world_size) if values[r]]
    if refused:
        raise ValueError(f"rank(s) {refused} refused their inputs to this layer call (see their error); nothing ran")
    _, k_max, k_min, h_max, h_min, d_max, d_min, e_max, e_min, s_max, s_min = values[2 * world_size :]
    if e_max != -e_min:
        raise ValueError(
            f"ranks disagree on the expert partition: num_experts from {-e_min} to {e_max}; "
            f"every rank's layer needs the same ExpertPartition"
        )
    if s_max != -s_min:
        raise ValueError(
            f"ranks disagree on the expert partition: scheme {SCHEMES[-s_min]!r} and {SCHEMES[s_max]!r}; "
            f"every rank's layer needs the same ExpertPartition"
        )
    if k_max != -k_min:
        raise ValueError(f"ranks disagree on top-k: K from {-k_min} to {k_max}; every rank's topk_ids need one K")
    if h_max != -h_min:
        raise ValueError(f"ranks disagree on the hidden size: H from {-h_min} to {h_max}")
    if d_max != -d_min:
        names = [str(COMPUTE_DTYPES[code]) for code in (-d_min, d_max)]
        raise TypeError(f"ranks disagree on hidden's dtype: {names[0]} and {names[1]} (and maybe others)")
    bad = [r for r in range(world_size) if values[world_size + r]]
    if bad:
        raise IndexError(f"topk_ids of rank(s) {bad} hold expert ids outside [-1, {num_experts}) (-1 = skip)")
