"""The eviction-policy interface shared by the runtime cache and the trace simulator.

A policy only orders keys; it never touches tensors or slots. A cache drives it in this
order for every call (`expertcache.call_plan`):

1. ``begin_call(keys)`` with the call's distinct keys in first-appearance order;
2. planning: ``choose_victim(protected, incoming=key)`` once per miss that finds no free
   slot, in first-appearance order, every choice on the state before the call (it must not
   change the policy; ``protected`` grows by each victim chosen, and a key it holds stays
   in it until the call ends, so a policy may resume its search where the last one stopped);
3. either the call happens: for each key in order ``on_hit(key)``, or ``on_evict(victim)``
   (when it took one) then ``on_miss(key)``; then ``end_call()``;
   or it is rolled back (a copy failed, an interrupt): ``abort_call()``, which undoes what
   ``begin_call`` (and a ``begin_forward`` just before it) changed.

The hooks of step 3 run once the call's copies and tables are committed. If one raises,
the cache takes the call back (slots, tables, counters) and puts the policy back as it was
before step 1, from the `snapshot` it took then, and the error propagates: nothing changed.
A policy of your own pays a `copy.deepcopy` of its attributes a call for that (override
`snapshot` and `restore` for a cheaper way, or for state a deep copy does not fit); the
built-in policies' hooks only update their own bookkeeping and never raise, so they take no
snapshot. Refuse bad settings when the policy is built, as the built-in ones do.

Two optional signals carry what some policies need beyond one call:

* ``begin_forward()`` before the first call of a forward pass (Least-Stale ranks keys by
  whether the current pass already used them); the slot pool infers it when a layer
  comes round again, the simulator takes it from the trace;
* ``set_future(calls)`` once, before any call, for clairvoyant policies (``clairvoyant =
  True``; Belady's MIN): the distinct keys of every call that will be admitted. Runtime
  caches never know the future, so such policies are for simulation only.

``protected`` holds every key of the current call (and, in a pool shared by several
layers, every key of another layer holding no more than its share: `expertcache.layer_shares`;
only ``key in protected`` may be asked): a policy must never return one of them (the table
checks). Keys are any hashables: an expert id, or ``(layer, expert)`` for a
pool shared by several layers.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Container, Hashable, Sequence
from typing import ClassVar

from expertcache.validation import check_int

Key = Hashable


class EvictionPolicy(ABC):
    """Orders resident keys and picks which one to drop."""

    #: Lower-case name under which `make_policy` finds the policy.
    name: ClassVar[str]

    #: True for oracles that must be told every future call through `set_future`.
    clairvoyant: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        """``capacity``: how many keys the cache holds (ARC, SLRU and others size by it), an
        integer (numpy's too, never a bool) of at least 1.

        Raises:
            TypeError: ``capacity`` is not an integer. ValueError: it is below 1.
        """
        self.capacity = check_int("capacity", capacity, minimum=1)

    def claim(self, owner: object) -> None:
        """Bind this instance to the one cache that drives it.

        A policy's state describes one cache's keys: a second cache (slot pool, simulator
        table, replay) driving the same instance would corrupt both.

        Raises:
            ValueError: the instance already belongs to a cache.
            TypeError: `snapshot` fails on it (state that cannot be deep-copied): a cache
                could not take back a call whose hooks raise.
        """
        if getattr(self, "_owner", None) is not None:
            raise ValueError(
                f"this {type(self).__name__} instance already drives another cache; give each cache its "
                f"own instance, or pass the policy's name ({self.name!r})"
            )
        try:
            self.snapshot()
        except Exception as err:
            raise TypeError(
                f"{type(self).__name__}.snapshot() failed ({type(err).__name__}: {err}); a cache snapshots a "
                "policy of your own before each call to take the call back if a hook raises: override "
                "snapshot() and restore() for state that copy.deepcopy cannot copy"
            ) from err
        self._owner = id(owner)

    def snapshot(self) -> object:
        """The policy's state now, for `restore` (taken before each call, so that a call
        whose hooks raise can be taken back).

        Default: None for the built-in policies (their hooks never raise: no copy a call),
        a ``copy.deepcopy`` of the instance's attributes for any other. Override both this
        and `restore` where that is costly or does not fit.
        """
        if _built_in(type(self)):
            return None
        return copy.deepcopy(self.__dict__)

    def restore(self, state: object) -> None:
        """Put back the state `snapshot` returned: the hooks of the call that followed
        raised. A built-in policy (no snapshot) forgets the call (``abort_call``)."""
        if state is None:
            self.abort_call()
            return
        assert isinstance(state, dict)
        self.__dict__.clear()
        self.__dict__.update(state)

    def begin_call(self, keys: Sequence[Key]) -> None:  # noqa: B027 - optional hook
        """A call starts; ``keys`` are its distinct keys in first-appearance order."""

    def end_call(self) -> None:  # noqa: B027 - optional hook
        """The call's admissions are done."""

    def abort_call(self) -> None:  # noqa: B027 - optional hook
        """The call that ``begin_call`` started was rolled back: forget it (and the
        ``begin_forward`` just before it, if any). No other signal came in between."""

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


def _built_in(cls: type) -> bool:
    """Whether ``cls`` is one of this package's policies (not a subclass written elsewhere)."""
    return cls.__module__.startswith("expertcache.policies.")
