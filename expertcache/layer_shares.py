"""Layer shares: how a pool shared by several layers keeps one LRU from thrashing.

One recency order over every layer of a global pool thrashes once the layers' calls
together need more experts than there are slots. Layers run in a cycle, so layer l's
misses evict the experts layer l + 1 is about to use, whose misses then evict layer l + 2's,
and so on. At 25% of Qwen3-30B-A3B's experts and 8 concurrent requests, plain LRU over a
12-layer pool hits 0% (per-layer pools: 42%). So a pool of ``S`` slots shared by ``L``
layers gives each layer a **share** of ``S // L`` slots:

* a miss of layer ``l`` takes its victim, in the policy's order, only among this layer's
  slots and the slots of layers holding *more* than their share (free slots go first, as
  always). A layer is never pushed below its share by another one;
* a call, or a pass of one (`expertcache.passes`: resident keys first, cut into groups of
  the share), holds at most ``share`` experts.

Together they guarantee that every pass finds its victims. Layer ``l`` holds ``c_l`` slots,
``h`` of them this pass's hits, and needs ``m <= share - h`` victims. The free slots plus
the other layers' slots above their shares number at least ``S - c_l - (L - 1) * share >=
share - c_l``, so with its own ``c_l - h`` idle slots the layer finds ``share - h >= m``.
A layer holds more than its share only while other layers leave theirs unused, so a hot
layer still borrows from cold ones. A pool of one layer has ``share = S``: nothing
changes. Host mode (any policy: `expertcache.call_plan`), the device LRU kernel
(`expertcache.kernels.admission`) and the simulator (`expertcache.slot_table`) apply the
same rule, so simulated copies stay the runtime's.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

from expertcache.policies import Key
from expertcache.validation import check_int


def layer_share(num_slots: int, num_layers: int) -> int:
    """Slots each of ``num_layers`` layers sharing ``num_slots`` slots keeps: ``S // L``.

    Raises:
        ValueError: fewer slots than layers (a layer's share would be empty).
    """
    if num_layers > num_slots:
        raise ValueError(
            f"a pool of {num_slots} slots can serve at most {num_slots} layers (each keeps num_slots // layers "
            f"slots), not {num_layers}"
        )
    return num_slots // max(1, num_layers)


def check_layers(num_layers: object, layer_of: object) -> None:
    """Check the layer arguments of a table or replay shared by ``num_layers`` layers.

    Raises:
        ValueError: ``num_layers`` below 1, or several layers without ``layer_of``.
        TypeError: ``num_layers`` not an integer, or a ``layer_of`` that is not callable.
    """
    if check_int("num_layers", num_layers, minimum=1) > 1 and layer_of is None:
        raise ValueError("a table or replay of several layers needs layer_of (the layer of a key)")
    if layer_of is not None and not callable(layer_of):
        raise TypeError(f"layer_of must be a function of a key, got {type(layer_of).__name__}")


@dataclass(frozen=True)
class LayerFloor:
    """What one call of ``layer`` may not take from the other layers of a shared pool.

    Attributes:
        layer: the calling layer.
        share: slots every layer keeps (`layer_share`).
        held: ``[L]`` slots each layer holds before the call.
        layer_of: the layer of a key.
    """

    layer: int
    share: int
    held: Sequence[int]
    layer_of: Callable[[Key], int]


class Protected(Container):
    """The call's keys, the victims chosen so far, and every key of another layer that holds
    no more than its share. `add` records a victim (its layer then holds one slot fewer);
    the counts are the call's own copy: planning changes nothing."""

    def __init__(self, taken: set[Key], floor: LayerFloor | None = None) -> None:
        self.taken = taken
        self.floor = floor
        held = [] if floor is None else list(floor.held)
        self.held = held
        #: layers whose keys are out of reach now (another layer, at or below its share)
        self.blocked = set() if floor is None else {
            index for index, count in enumerate(held) if index != floor.layer and count <= floor.share
        }  # fmt: skip

    def __contains__(self, key: object) -> bool:
        if key in self.taken:
            return True
        return bool(self.blocked) and self.floor is not None and self.floor.layer_of(key) in self.blocked

    def add(self, victim: Key) -> None:
        self.taken.add(victim)
        floor = self.floor
        if floor is not None:
            owner = floor.layer_of(victim)
            self.held[owner] -= 1
            if owner != floor.layer and self.held[owner] <= floor.share:
                self.blocked.add(owner)
