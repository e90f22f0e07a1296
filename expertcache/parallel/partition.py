"""`ExpertPartition`: which rank owns which expert of a layer under expert parallelism.

Two schemes, for ``E`` experts over ``R`` ranks:

* ``"contiguous"`` (the default, vLLM's "linear" placement): rank ``r`` owns one block of
  consecutive ids; the first ``E % R`` ranks own one expert more than the rest, e.g.
  ``E=10, R=4 -> [0,1,2] [3,4,5] [6,7] [8,9]``.
* ``"round_robin"``: expert ``e`` lives on rank ``e % R``, e.g. ``E=10, R=4 ->
  [0,4,8] [1,5,9] [2,6] [3,7]``. It spreads neighbouring ids, which some routers favour
  together, over all ranks.

Every expert has exactly one owner and every rank owns at least one (``E >= R``). A rank's
local index of an expert is its position among the rank's experts in ascending global
order; `expert_map` is the ``[E]`` int32 table (local index, or -1) that
`CachedWeightProvider` takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from expertcache.validation import check_int

SCHEMES = ("contiguous", "round_robin")


@dataclass(frozen=True, slots=True)
class ExpertPartition:
    """Placement of ``num_experts`` experts on ``world_size`` ranks.

    Attributes:
        num_experts: experts of the layer ``E`` (global ids ``0 .. E-1``).
        world_size: ranks ``R``, ``1 <= R <= E``.
        scheme: ``"contiguous"`` or ``"round_robin"`` (see the module docstring).
    """

    num_experts: int
    world_size: int
    scheme: str = "contiguous"

    def __post_init__(self) -> None:
        for name in ("num_experts", "world_size"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        if self.world_size > self.num_experts:
            raise ValueError(
                f"world_size {self.world_size} exceeds num_experts {self.num_experts}: "
                f"every rank must own at least one expert"
            )
        if not isinstance(self.scheme, str):
            raise TypeError(f"scheme must be a str, one of {list(SCHEMES)}; got {type(self.scheme).__name__}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r}; known: {list(SCHEMES)}")

    def owners(self) -> np.ndarray:
        """``[E]`` int64: the rank owning each global expert id."""
        experts = np.arange(self.num_experts, dtype=np.int64)
        if self.scheme == "round_robin":
            return experts % self.world_size
        base, extra = divmod(self.num_experts, self.world_size)
        # The first `extra` ranks own base + 1 experts, the others base.
        boundary = extra * (base + 1)
        return np.where(
            experts < boundary,
            experts // (base + 1),
            extra + (experts - boundary) // max(base, 1),
        )

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """Global ids owned by ``rank``, ascending (position = local index).

        Raises:
            TypeError: ``rank`` is not an integer (a bool, float or str is refused).
            ValueError: ``rank`` is outside ``[0, world_size)``.
        """
        rank = self.check_rank(rank)
        return tuple(np.flatnonzero(self.owners() == rank).tolist())

    def expert_map(self, rank: int) -> torch.Tensor:
        """``[E]`` int32 CPU table for ``rank``: global id -> local index, -1 if not owned
        (``rank`` checked as in `local_experts`)."""
        table = torch.full((self.num_experts,), -1, dtype=torch.int32)
        local = torch.tensor(self.local_experts(rank), dtype=torch.int64)
        table[local] = torch.arange(local.numel(), dtype=torch.int32)
        return table

    def check_rank(self, rank: object) -> int:
        """``rank`` as a Python int in ``[0, world_size)`` (numpy integers accepted).

        Raises:
            TypeError: not an integer (``True``, ``1.0`` and ``"1"`` are not ranks).
            ValueError: outside ``[0, world_size)``.
        """
        number = check_int("rank", rank, expected=f"an int in [0, {self.world_size})")
        if not 0 <= number < self.world_size:
            raise ValueError(f"rank {number} is outside [0, {self.world_size})")
        return number
