"""Landing counts: an apply that starts on each copied expert as it lands.

A device-mode call copies its misses with one copy-kernel launch per copy group. Without
landing counts the apply of the misses waits for the whole launch (a stream event), so
after the layer's last byte arrives the whole misses' apply still runs. With them::

    admission    zero the pass's counters [S] int32, then write `target` at its hits' slots
    copy kernel  landed[slot] += what the chunks stored count, per program each time it
                 moves to another name or expert (after a barrier, with release semantics
                 at GPU scope)
    apply        per (pair | block of pairs): spin until the slot's count says what it reads
                 has landed, acquire, then read the slot; launched once the admission is
                 done, not the copies. GEMV gate_up: ``landed[slot] & gate_up_mask >=
                 gate_up_target`` (its w1); the grouped GEMM's: ``landed[slot] >= target``
    GEMV down    per pair: spin until each of its gate_up tiles has counted itself into a
                 per-call counter of the pair (``done``), instead of waiting for all of
                 gate_up, and until ``landed[slot] >= target`` (its w2)

``target`` is what one expert counts over all of the layer's copy groups, so a slot reads
``target`` once every byte of its expert has landed. The names gate_up reads
(``GATE_UP_NAMES``) count one per chunk, every other name ``DOWN_UNIT`` per chunk, and a
program counts each name's chunks once it moves on to another name or expert: so
``landed[slot] & (DOWN_UNIT - 1)`` reaches the expert's gate_up chunks once its ``w1``
(and ``w1_scale``) have landed, while its ``w2`` may still be arriving, and the GEMV's
gate_up starts then; down waits for the whole target (`Counting`). A pass hands its
counters to the apply in `expertcache.result.Landing`; only kernels that call
`wait_landed` may be given such a result (``provider.passes(ids, overlap=True,
landing=True)``).

Progress: a waiting program never waits for a program launched after it. gate_up waits
for the copy kernel, whose programs are launched while the admission runs (a programmatic
edge in the captured graph) on the copy stream, whose higher priority the graph keeps per
node, while the apply can start only once the admission is done; down waits for gate_up,
which it follows by programmatic launch (down's programs start only once every gate_up
program has), and ends only after all of gate_up. This rests on CUDA scheduling resident
and higher-priority work first, which it documents as a preference, not a guarantee; that
is why only captured graphs (and the interpreter, whose programs run in order) take
landing counts, and eager GPU calls wait for whole copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import triton
import triton.language as tl

#: Names the GEMV's gate_up reads (`expertcache.kernels.expert_apply`): each of their
#: chunks counts 1; every other name's counts ``DOWN_UNIT``.
GATE_UP_NAMES = frozenset({"w1", "w1_scale"})
DOWN_UNIT = 1 << 16
_MAX_COUNT = 2**31 - 1


class Counting(NamedTuple):
    """What one expert's copies count into its slot's landing counter.

    Attributes:
        weights: what one stored chunk of each name adds.
        target: the count once every name has landed.
        gate_up_target: ``count & gate_up_mask`` reaches it once the ``GATE_UP_NAMES`` have.
        gate_up_mask: ``DOWN_UNIT - 1``, or -1 (every bit) when the names are not counted
            apart (a layer without them, or too many chunks for one int32).
    """

    weights: dict[str, int]
    target: int
    gate_up_target: int
    gate_up_mask: int

    @classmethod
    def of(cls, chunks: Mapping[str, int]) -> Counting:
        """The counting of an expert whose names take ``chunks`` (per name) copy chunks."""
        early = sum(count for name, count in chunks.items() if name in GATE_UP_NAMES)
        late = sum(count for name, count in chunks.items() if name not in GATE_UP_NAMES)
        if 0 < early < DOWN_UNIT and 0 < late and early + late * DOWN_UNIT <= _MAX_COUNT:
            weights = {name: 1 if name in GATE_UP_NAMES else DOWN_UNIT for name in chunks}
            return cls(weights, early + late * DOWN_UNIT, early, DOWN_UNIT - 1)
        return cls(dict.fromkeys(chunks, 1), early + late, early + late, -1)


def check_landed(landed: torch.Tensor, num_slots: int, device: torch.device, target: int | None = None) -> None:
    """Refuse landing counters that are not ``[S]`` int32 on ``device``, or (given) a target below one."""
    if landed.dtype != torch.int32 or landed.shape != (num_slots,) or landed.device != device:
        raise ValueError(f"landed must be an int32 counter per slot ({num_slots}) on {device}")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < 1):
        raise ValueError(f"landed_target must be a positive int (an expert's chunks), got {target!r}")


@triton.jit
def wait_landed(landed_ptr, slot, target, mask):
    """Block the program until ``landed[slot] & mask >= target`` (``mask`` -1: the whole
    count); the program's later loads see every byte stored before the counts it waited
    for (by the copy kernel, or gate_up)."""
    while (tl.load(landed_ptr + slot, volatile=True) & mask) < target:
        pass
    tl.atomic_add(landed_ptr + slot, 0, sem="acquire", scope="gpu")  # one thread acquires ...
    tl.debug_barrier()  # ... and the program's other threads read after it
