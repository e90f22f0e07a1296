"""Eviction policies, found by lower-case name.

Add a policy by subclassing `EvictionPolicy` and listing it in ``POLICIES``: the providers,
the slot table and the simulator take it unchanged.
"""

from __future__ import annotations

from expertcache.policies.arc import ARCPolicy
from expertcache.policies.base import EvictionPolicy, Key
from expertcache.policies.belady import BeladyPolicy
from expertcache.policies.gdsf import GDSFPolicy
from expertcache.policies.least_stale import LeastStalePolicy
from expertcache.policies.lfru import LFRUPolicy
from expertcache.policies.lfu import LFUPolicy
from expertcache.policies.lru import LRUPolicy
from expertcache.policies.slru import SLRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    policy.name: policy
    for policy in (
        LRUPolicy,
        LFUPolicy,
        SLRUPolicy,
        ARCPolicy,
        LFRUPolicy,
        LeastStalePolicy,
        GDSFPolicy,
        BeladyPolicy,
    )
}


def make_policy(policy: str | EvictionPolicy, *, capacity: int) -> EvictionPolicy:
    """Return a fresh policy for a name such as ``"lru"``, or ``policy`` itself if given one.

    ``capacity`` is the number of keys the cache holds. Names: ``"lru"`` (the default),
    ``"lfu"``, ``"slru"``, ``"arc"``, ``"lfru"``, ``"least_stale"``, ``"gdsf"`` (uniform cost;
    build `GDSFPolicy` with ``cost=`` for experts of different bytes) and ``"belady"``
    (clairvoyant, simulation only).

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
        TypeError: for anything that is neither a name nor an `EvictionPolicy`.
    """
    if isinstance(policy, EvictionPolicy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a name or an EvictionPolicy, got {type(policy).__name__}")
    try:
        cls = POLICIES[policy.lower()]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown eviction policy {policy!r}; known policies: {known}") from None
    return cls(capacity=capacity)


def claim_policy(policy: str | EvictionPolicy, *, capacity: int, owner: object) -> EvictionPolicy:
    """`make_policy`, then bind the policy to ``owner``, the one cache that will drive it.

    Raises:
        ValueError: an unknown name; an instance built for another capacity; an instance
            that already drives another cache.
        TypeError: neither a name nor an `EvictionPolicy`.
    """
    chosen = make_policy(policy, capacity=capacity)
    if chosen.capacity != capacity:
        raise ValueError(
            f"the {chosen.name!r} policy instance was built for capacity {chosen.capacity}, not {capacity}"
        )
    chosen.claim(owner)
    return chosen


__all__ = [
    "POLICIES",
    "ARCPolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "GDSFPolicy",
    "Key",
    "LFRUPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "LeastStalePolicy",
    "SLRUPolicy",
    "claim_policy",
    "make_policy",
]
