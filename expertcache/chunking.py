"""Splitting one call's tokens so that each piece's distinct experts fit in the slots.

A prefill can route its tokens to more distinct experts than the cache has slots. Every
token's MoE output depends only on its own row, so the call can run as consecutive token
pieces, each needing at most ``capacity`` experts at once: the outputs are the same, the
engine does not crash, and the cache keeps its never-evict-what-this-call-needs rule.
"""

from __future__ import annotations

import numpy as np


def split_to_capacity(topk_ids: np.ndarray, capacity: int) -> list[slice]:
    """Consecutive row slices whose distinct non-negative ids number at most ``capacity``.

    Args:
        topk_ids: ``[T, K]`` integer expert ids on the host; -1 entries are ignored.
        capacity: slots available to one call (at least the distinct ids of any one row).

    Returns:
        Slices covering ``0 .. T`` in order; one slice when everything fits.

    Raises:
        ValueError: a single row needs more than ``capacity`` distinct ids.
    """
    rows = np.asarray(topk_ids)
    pieces: list[slice] = []
    start, seen = 0, set[int]()
    for index, row in enumerate(rows.tolist()):
        needed = {int(e) for e in row if e >= 0}
        if len(needed) > capacity:
            raise ValueError(
                f"token {index} needs {len(needed)} distinct experts at once but only {capacity} "
                f"slots are available; the cache size must be at least the router's top-k"
            )
        if len(seen | needed) > capacity:
            pieces.append(slice(start, index))
            start, seen = index, set[int]()
        seen |= needed
    pieces.append(slice(start, len(rows)))
    return pieces
