"""Cache statistics: exact counters, read through immutable snapshots."""

from __future__ import annotations

from dataclasses import dataclass, fields

from expertcache.validation import check_int

#: The largest count a counter may hold: what the int64 tensors of `gather_stats` carry.
MAX_COUNT = 2**63 - 1


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters of one provider (or a sum over several).

    Attributes:
        hits: distinct local experts of a call that were already resident, summed over calls.
        misses: distinct local experts of a call that had to be copied in, summed over calls.
        evictions: resident experts dropped to make room, summed over calls.
        bytes_h2d: bytes copied from the host store into slots (as they land: raw bytes).
        calls: ``prepare`` calls that completed.
        invalid_ids: ids outside ``[0, E)`` that device mode mapped to -1 instead of raising
            (it cannot raise without a host sync); always 0 in host mode, which raises.
        overflows: device-mode calls refused on the device because they needed more
            distinct experts than slots (nothing changed, their ids came out -1); the
            paths that read ids on the host raise `CacheCapacityError` instead.
        compressed_bytes_h2d: bytes the same copies read from the host store, as stored:
            smaller than ``bytes_h2d`` when the store is compressed
            (``compression="exponent"``), equal to it otherwise.
    """

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_h2d: int = 0
    calls: int = 0
    invalid_ids: int = 0
    overflows: int = 0
    compressed_bytes_h2d: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 1.0 before any lookup."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 1.0

    def __add__(self, other: CacheStats) -> CacheStats:
        return CacheStats(
            self.hits + other.hits,
            self.misses + other.misses,
            self.evictions + other.evictions,
            self.bytes_h2d + other.bytes_h2d,
            self.calls + other.calls,
            self.invalid_ids + other.invalid_ids,
            self.overflows + other.overflows,
            self.compressed_bytes_h2d + other.compressed_bytes_h2d,
        )


def checked_counts(stats: CacheStats) -> tuple[int, ...]:
    """``stats``'s counters as Python ints in field order (numpy ints too), for what exposes
    or exchanges them: the metrics collector and `expertcache.parallel.gather_stats`.

    Raises:
        TypeError: a counter is not an integer (a float, a str, None, a bool).
        ValueError: a counter is negative or beyond int64 (`MAX_COUNT`).
    """
    return tuple(
        check_int(field.name, getattr(stats, field.name), minimum=0, maximum=MAX_COUNT, expected="an int count >= 0")
        for field in fields(CacheStats)
    )
