"""`ForwardTracker`: where host mode infers that a forward pass starts (a layer coming round
again), for the policies that rank by forward passes (``begin_forward``). Pure Python."""

from __future__ import annotations

from collections.abc import Hashable


class ForwardTracker:
    """Infers forward-pass starts for policies that rank by them: a layer coming round again."""

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()

    def starts_forward(self, layer: Hashable) -> bool:
        """Whether a call of ``layer`` now would start a pass (changes nothing)."""
        return not self._seen or layer in self._seen

    def record(self, layer: Hashable) -> None:
        """A call of ``layer`` completed."""
        if layer in self._seen:
            self._seen.clear()
        self._seen.add(layer)
