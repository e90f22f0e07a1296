"""The eviction-policy interface shared by the runtime cache and the trace simulator.

A policy only orders keys; it never touches tensors or slots. The slot table drives it with
one signal per event, in this order for every call:

1. ``begin_call(keys)`` with the call's distinct keys in first-appearance order;
2. for each key in that order: ``on_hit(key)`` if resident, else, when the cache is full,
   ``choose_victim(protected, incoming=key)`` then ``on_evict(victim)``, then
   ``on_miss(key)`` once the key holds a slot;
3. ``end_call()``.

Two optional signals carry what some policies need beyond one call:

* ``begin_forward()`` before the first call of a forward pass (Least-Stale ranks keys by
  whether the current pass already used them); the slot pool infers it when a layer
  comes round again, the simulator takes it from the trace;
* ``set_future(calls)`` once, before any call, for clairvoyant policies (``clairvoyant =
  True``; Belady's MIN): the distinct keys of every call that will be admitted. Runtime
  caches never know the future, so such policies are for simulation only.

``protected`` holds every key of the current call: a policy must never return one of them
(the table checks). Keys are any hashables: an expert id, or ``(layer, expert)`` for a
pool shared by several layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Hashable, Sequence
from typing import ClassVar

Key = Hashable


class EvictionPolicy(ABC):
    """Orders resident keys and picks which one to drop."""

    #: Lower-case name under which `make_policy` finds the policy.
    name: ClassVar[str]

    #: True for oracles that must be told every future call through `set_future`.
    clairvoyant: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        """``capacity``: how many keys the cache holds (ARC, SLRU and others size by it)."""
        self.capacity = capacity

    def begin_call(self, keys: Sequence[Key]) -> None:  # noqa: B027 - optional hook
        """A call starts; ``keys`` are its distinct keys in first-appearance order."""

    def end_call(self) -> None:  # noqa: B027 - optional hook
        """The call's admissions are done."""

    def begin_forward(self) -> None:  # noqa: B027 - optional hook
        """A forward pass starts: the calls that follow (one per layer) belong to it."""

    def set_future(self, calls: Sequence[Sequence[Key]]) -> None:
        """Tell a clairvoyant policy every call it will see (distinct keys, in order).

        Raises:
            TypeError: the policy is not clairvoyant.
        """
        raise TypeError(f"policy {self.name!r} does not take the future")

    @abstractmethod
    def on_hit(self, key: Key) -> None:
        """``key`` was resident and is used by the current call."""

    @abstractmethod
    def on_miss(self, key: Key) -> None:
        """``key`` was not resident and now holds a slot."""

    @abstractmethod
    def on_evict(self, key: Key) -> None:
        """``key`` lost its slot (it was the victim just chosen)."""

    @abstractmethod
    def choose_victim(self, protected: Container[Key], incoming: Key) -> Key:
        """Return a resident key not in ``protected`` to evict so ``incoming`` can enter.

        Must not change the policy's state: the table reports the choice back through
        ``on_evict``.
        """
