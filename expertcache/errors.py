"""Exceptions raised by expertcache.

Every error leaves the cache as it was: after any exception (including one raised half-way
through a call, which is rolled back) the slot tables, the policy, the statistics and the
slot contents are exactly as they were before the call.
"""

from __future__ import annotations


class CacheCapacityError(ValueError):
    """One call needs more distinct experts than the cache has slots (for a cache shared by
    several layers: than a layer's share, `expertcache.layer_shares`).

    Attributes:
        needed: distinct experts (or (layer, expert) keys) the call needs at once.
        num_slots: slots available to the call (the share, when shared).
        layers: layers sharing the cache.
    """

    def __init__(self, needed: int, num_slots: int, *, where: str = "", layers: int = 1) -> None:
        self.needed = needed
        self.num_slots = num_slots
        self.layers = layers
        place = f" ({where})" if where else ""
        has = (
            f"has only {num_slots} slots; raise the cache size to at least {needed} "
            f"(--moe-expert-cache-size {needed}, or cache_size={needed})"
            if layers == 1
            else f"is shared by {layers} layers and a layer's call may hold only its share, {num_slots} "
            f"(num_slots // layers); raise the pool's slots to at least {needed * layers}"
        )
        super().__init__(
            f"this call needs {needed} distinct experts resident at once{place}, but the expert cache {has}, "
            f"or serve the call in expert-group passes (provider.passes(topk_ids))"
        )


class PinBudgetError(ValueError):
    """Pinning the backing store would exceed the caller's pinned-memory budget."""

    def __init__(self, needed: int, budget: int) -> None:
        self.needed = needed
        self.budget = budget
        super().__init__(
            f"the pinned backing store needs {needed} bytes ({needed / 2**30:.2f} GiB) but "
            f"pin_budget_bytes is {budget} ({budget / 2**30:.2f} GiB); nothing was pinned. "
            f"Raise the budget (--moe-pin-budget) or serve fewer experts from this process"
        )


class ConcurrentUseError(RuntimeError):
    """A slot pool was entered by a second thread while a call was in flight."""
