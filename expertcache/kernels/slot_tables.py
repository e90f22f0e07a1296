"""The slot tables of one pool: every piece of cache state, on the cache's device, in one buffer.

Both modes keep their state here (the host-mode planner reads a snapshot of it; it keeps
no table of its own). Packed into one allocation so that a whole-state snapshot (device
mode's rollback) is a single copy and ``torch.compile`` sees one mutated tensor::

    expert_to_slot [num_keys] int32        slot of each key, -1 = not resident
    slot_to_key    [S] int32               key in each slot, -1 = free
    last_use       [S] int64               LRU recency stamp, -1 = never used (device mode)
    clock          [1] int64               next stamp base (device mode)
    counters       [layers, 6] int64       hits, misses, evictions, calls, invalid ids, overflows
    prefetched     [layers, 6] int64       the same counts, of prefetches (device mode)
    plan           [1 + 4 S] int32         plan[0] = copies; entry r at 1 + 4 r: expert, slot, key, evicted key
    first_seen     [num_keys] int32        scratch of the large admission kernel, INT32_MAX between calls
    miss_stamp     [S] int64               scratch of the admission kernels

A key is ``key_offset(layer) + local expert``: the layers of a shared pool own consecutive
key ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from expertcache.layer_shares import layer_share

COUNTERS = ("hits", "misses", "evictions", "calls", "invalid_ids", "overflows")
NUM_COUNTERS = len(COUNTERS)
PLAN_FIELDS = ("expert", "slot", "key", "evicted")
FIRST_SEEN_EMPTY = 2**31 - 1

# (name, dtype, length as a function of (num_keys, num_slots, num_layers), initial value)
_FIELDS = (
    ("expert_to_slot", torch.int32, lambda k, s, n: k, -1),
    ("slot_to_key", torch.int32, lambda k, s, n: s, -1),
    ("last_use", torch.int64, lambda k, s, n: s, -1),
    ("clock", torch.int64, lambda k, s, n: 1, 0),
    ("counters", torch.int64, lambda k, s, n: n * NUM_COUNTERS, 0),
    ("prefetched", torch.int64, lambda k, s, n: n * NUM_COUNTERS, 0),
    ("plan", torch.int32, lambda k, s, n: 1 + len(PLAN_FIELDS) * s, 0),
    ("first_seen", torch.int32, lambda k, s, n: k, FIRST_SEEN_EMPTY),
    ("miss_stamp", torch.int64, lambda k, s, n: s, 0),
)


@triton.jit
def add_counts(counters_ptr, layer, hits, misses, evictions, calls, invalid, overflows):
    """Add one call's counts to the layer's row: one vector atomic, not six scalar updates."""
    lanes = tl.arange(0, 8)
    values = tl.where(lanes == 0, hits, tl.where(lanes == 1, misses, tl.where(lanes == 2, evictions, 0)))
    values = tl.where(lanes == 3, calls, tl.where(lanes == 4, invalid, tl.where(lanes == 5, overflows, values)))
    tl.atomic_add(counters_ptr + layer * 6 + lanes, values.to(tl.int64), mask=lanes < 6)


def _spans(num_keys: int, num_slots: int, num_layers: int) -> list[tuple[str, torch.dtype, int, int, int]]:
    """``(name, dtype, byte offset, length, initial value)`` of each field, 8-byte aligned."""
    spans, cursor = [], 0
    for name, dtype, length, initial in _FIELDS:
        count = length(num_keys, num_slots, num_layers)
        spans.append((name, dtype, cursor, count, initial))
        cursor += -(-count * dtype.itemsize // 8) * 8
    return spans


@dataclass(frozen=True)
class SlotTables:
    """Typed views of one pool's state buffer (see the module docstring)."""

    buffer: torch.Tensor
    num_keys: int
    num_slots: int
    num_layers: int
    expert_to_slot: torch.Tensor
    slot_to_key: torch.Tensor
    last_use: torch.Tensor
    clock: torch.Tensor
    counters: torch.Tensor
    prefetched: torch.Tensor
    plan: torch.Tensor
    first_seen: torch.Tensor
    miss_stamp: torch.Tensor

    @staticmethod
    def buffer_bytes(num_keys: int, num_slots: int, num_layers: int) -> int:
        _, dtype, offset, count, _ = _spans(num_keys, num_slots, num_layers)[-1]
        return offset + -(-count * dtype.itemsize // 8) * 8

    @classmethod
    def allocate(cls, num_keys: int, num_slots: int, num_layers: int, device: torch.device) -> SlotTables:
        """Fresh tables: nothing resident, counters zero."""
        # Outside inference mode, buffer and views alike: in-place updates must work inside and
        # outside it (a view made inside it refuses in-place updates outside).
        with torch.inference_mode(False):
            buffer = torch.empty(cls.buffer_bytes(num_keys, num_slots, num_layers), dtype=torch.uint8, device=device)
            tables = cls.view(buffer, num_keys, num_slots, num_layers)
            for name, _, _, _, initial in _spans(num_keys, num_slots, num_layers):
                getattr(tables, name).fill_(initial)
        return tables

    @classmethod
    def view(cls, buffer: torch.Tensor, num_keys: int, num_slots: int, num_layers: int) -> SlotTables:
        """The tables stored in ``buffer`` (``[buffer_bytes]`` uint8)."""
        fields = {}
        for name, dtype, offset, count, _ in _spans(num_keys, num_slots, num_layers):
            fields[name] = buffer[offset : offset + count * dtype.itemsize].view(dtype)
        fields["counters"] = fields["counters"].view(num_layers, NUM_COUNTERS)
        fields["prefetched"] = fields["prefetched"].view(num_layers, NUM_COUNTERS)
        return cls(buffer, num_keys, num_slots, num_layers, **fields)

    @property
    def share(self) -> int:
        """Keys one pass may hold, and slots every layer keeps (`expertcache.layer_shares`)."""
        return layer_share(self.num_slots, self.num_layers)

    @property
    def committed(self) -> torch.Tensor:
        """The bytes a call commits (the two tables, recency, clock, counters of calls and of
        prefetches; they lead the buffer): one copy of them is a snapshot to roll back to."""
        name, dtype, offset, count, _ = _spans(self.num_keys, self.num_slots, self.num_layers)[5]
        assert name == "prefetched"
        return self.buffer[: offset + count * dtype.itemsize]

    def plan_entries(self) -> torch.Tensor:
        """``[S, 4]`` view of the plan entries (expert, slot, key, evicted key)."""
        return self.plan[1:].view(self.num_slots, len(PLAN_FIELDS))

    def plan_on_host(self) -> torch.Tensor:
        """``[count, 4]`` int32 on the CPU: the planned entries, read in one copy (a sync)."""
        plan = self.plan.cpu()
        return plan[1:].view(self.num_slots, len(PLAN_FIELDS))[: int(plan[0])]
