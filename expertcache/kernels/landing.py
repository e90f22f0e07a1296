"""Landing counts: an apply that starts on each copied expert as it lands.

A device-mode call copies its misses with one copy-kernel launch per copy group. Without
landing counts the apply of the misses waits for the whole launch (a stream event), so
after the layer's last byte arrives the whole misses' apply still runs. With them::

    admission    zero the pass's counters [S] int32, then write `target` at its hits' slots
    copy kernel  landed[slot] += chunks stored, per program each time it moves to another
                 expert (after a barrier, with release semantics at GPU scope)
    apply        per (pair | block of pairs): spin until landed[slot] >= target, acquire,
                 then read the slot; launched once the admission is done, not the copies
    GEMV down    per pair: spin until each of its gate_up tiles has counted itself into a
                 per-call counter of the pair (``done``), instead of waiting for all of gate_up

``target`` is the chunks one expert takes over all of the layer's copy groups, so a slot
reads ``target`` once every byte of its expert has landed. A pass hands its counters to the
apply in `expertcache.result.Landing`; only kernels that call `wait_landed` may be given
such a result (``provider.passes(ids, overlap=True, landing=True)``).

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

import torch
import triton
import triton.language as tl


def check_landed(landed: torch.Tensor, num_slots: int, device: torch.device, target: int | None = None) -> None:
    """Refuse landing counters that are not ``[S]`` int32 on ``device``, or (given) a target below one."""
    if landed.dtype != torch.int32 or landed.shape != (num_slots,) or landed.device != device:
        raise ValueError(f"landed must be an int32 counter per slot ({num_slots}) on {device}")
    if target is not None and (not isinstance(target, int) or target < 1):
        raise ValueError(f"landed_target must be a positive int (an expert's chunks), got {target!r}")


@triton.jit
def wait_landed(landed_ptr, slot, target):
    """Block the program until ``landed[slot] >= target``; the program's later loads see
    every byte stored before the counts it waited for (by the copy kernel, or gate_up)."""
    while tl.load(landed_ptr + slot, volatile=True) < target:
        pass
    tl.atomic_add(landed_ptr + slot, 0, sem="acquire", scope="gpu")  # one thread acquires ...
    tl.debug_barrier()  # ... and the program's other threads read after it
