"""`SlotTable`: the trace simulator's cache, a plain-Python table driven by the runtime's planner.

No tensors: ``admit`` plans a call with `expertcache.call_plan.plan_call` (the same code host
mode runs) and applies it to two dicts, so simulated decisions are the runtime's. Slots are
never freed, only reused, so the free slots are ``[filled, num_slots)`` and nothing is
allocated per slot (a capacity of ``2**40`` costs what a capacity of 4 does). A table shared
by several layers keeps each layer's share (`expertcache.layer_shares`), as a shared pool does.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator

from expertcache.call_plan import CallPlan, plan_call, tell_policy
from expertcache.errors import CacheCapacityError
from expertcache.layer_shares import LayerFloor, check_layers, layer_share
from expertcache.passes import group_passes
from expertcache.policies import EvictionPolicy, Key, claim_policy
from expertcache.validation import MAX_SLOTS, check_int


class SlotTable:
    """Maps keys to ``num_slots`` slots under an eviction policy.

    Args:
        num_slots: slots of the cache, at least 1.
        policy: a policy name or a fresh `EvictionPolicy` (an instance serves one table).
        num_layers: layers sharing the table (at most ``num_slots``); each call is one layer's.
        layer_of: the layer of a key, in ``[0, num_layers)`` (needed when ``num_layers > 1``;
            with one layer, every key's must be 0).

    Invariants (checked by the tests after every call): ``slot_of`` and ``key_in`` are
    inverse on resident keys, at most ``num_slots`` keys are resident, and a slot never
    changes its number.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        policy: str | EvictionPolicy = "lru",
        num_layers: int = 1,
        layer_of: Callable[[Key], int] | None = None,
    ) -> None:
        num_slots = check_int("num_slots", num_slots, minimum=1, maximum=MAX_SLOTS)
        check_layers(num_layers, layer_of)
        self.num_slots = num_slots
        #: slots one call may hold, and that every layer keeps (`expertcache.layer_shares`)
        self.share = layer_share(num_slots, num_layers)
        self.num_layers = num_layers
        self._layer_of: Callable[[Key], int] = layer_of if layer_of is not None else _one_layer
        self._held = [0] * num_layers  # slots each layer holds
        self.policy = claim_policy(policy, capacity=num_slots, owner=self)
        self._slot_of: dict[Key, int] = {}
        self._key_in: dict[int, Key] = {}
        self._filled = 0  # slots [0, filled) have held a key; the rest are free

    def slot_of(self, key: Key) -> int:
        """The key's slot, or -1 when it is not resident."""
        return self._slot_of.get(key, -1)

    def key_in(self, slot: int) -> Key | None:
        """The key held by ``slot``, or None when the slot is free."""
        return self._key_in.get(slot)

    def resident(self) -> frozenset[Key]:
        """Every key that holds a slot."""
        return frozenset(self._slot_of)

    def begin_forward(self) -> None:
        """Mark the start of a forward pass for policies that rank by it (Least-Stale)."""
        self.policy.begin_forward()

    def admit(self, keys: Iterable[Key]) -> CallPlan:
        """Make every key of one call resident and report what moved.

        Args:
            keys: the call's keys in use order; repeats are allowed and ignored.

        Raises:
            CacheCapacityError: more distinct keys than ``share`` (all slots for one layer);
                nothing changes.
            ValueError: keys of several layers in one call, or a key whose ``layer_of`` is
                not in ``[0, num_layers)``; nothing changes.
        """
        unique = list(dict.fromkeys(keys))
        layer = self._layer_of_call(unique)
        if len(unique) > self.share:
            raise CacheCapacityError(len(unique), self.share, layers=self.num_layers)
        floor = None if layer is None else LayerFloor(layer, self.share, self._held, self._layer_of)
        before = self.policy.snapshot()
        plan = plan_call(
            unique,
            [self._slot_of.get(key, -1) for key in unique],
            slot_of=self.slot_of,
            free_slots=self._free_slots,
            policy=self.policy,
            floor=floor,
        )
        tell_policy(plan, self.policy, before)  # before the table changes: a hook that raises changes nothing
        for load in plan.loads:
            if load.evicted is not None:
                del self._slot_of[load.evicted]
                self._count(load.evicted, -1)
            self._count(load.key, +1)
            self._slot_of[load.key] = load.slot
            self._key_in[load.slot] = load.key
            self._filled = max(self._filled, load.slot + 1)
        return plan

    def admit_passes(self, keys: Iterable[Key], *, overlap: bool = False) -> list[CallPlan]:
        """Admit one call of any size in expert-group passes, as the runtime serves it.

        Args:
            keys: the call's keys in use order; repeats are allowed and ignored.
            overlap: group as overlapped passes (``passes(ids, overlap=True)``).

        Returns:
            One `CallPlan` per pass (`expertcache.passes.group_passes` on the table's
            state): one when the call fits.

        Raises:
            ValueError: as `admit`, before any pass is admitted.
        """
        unique = list(dict.fromkeys(keys))
        self._layer_of_call(unique)
        groups = group_passes(unique, [key in self._slot_of for key in unique], self.share, overlap=overlap)
        return [self.admit(group) for group in groups]

    def _layer_of_call(self, unique: list[Key]) -> int | None:
        """The one layer of a call's keys (None for a table of one layer, or no keys).

        A ``layer_of`` given to a table of one layer is still checked: every key's is 0.
        """
        if not unique or self._layer_of is _one_layer:
            return None
        layers = {self._layer_of(key) for key in unique}
        for layer in layers:  # any integer (numpy's too), never a bool
            if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < self.num_layers:
                raise ValueError(f"layer_of gave {layer!r}, not a layer in [0, {self.num_layers})")
        if len(layers) > 1:
            raise ValueError(f"a call of a shared table holds the keys of one layer, not of layers {sorted(layers)}")
        return int(layers.pop()) if self.num_layers > 1 else None

    def _count(self, key: Key, change: int) -> None:
        if self.num_layers > 1:
            self._held[self._layer_of(key)] += change

    def _free_slots(self) -> Iterator[int]:
        return iter(range(self._filled, self.num_slots))


def _one_layer(key: Key) -> int:
    """The layer of every key of a table of one layer."""
    return 0
