"""Calls of a `RoutingTrace` for a per-layer or a global (all-layer) slot pool.

Per layer: layer ``l`` sees one call per forward pass, the experts its tokens chose, and has
its own pool of ``capacity`` slots. Global: one pool of ``capacity`` slots for all layers,
keys ``layer_column * num_experts + expert`` (ints, cheaper to hash than tuples), calls in
execution order: every layer of forward pass 0, then of pass 1, and so on. Token rows with
no record (``-1``: dropped by the recorder) are skipped; a layer with no record in a pass
makes no call.

A global pool needs the rows of a forward pass to be the same tokens at every layer. A trace
whose notes say they are not (`RoutingTrace.layers_aligned`: the Mixtral decode-only files,
whose records were renumbered per layer after a lost one) gives only approximate global
counts: ``trace_calls(scope="global")`` warns with `ApproximateReplayWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from expertcache.policies import EvictionPolicy
from expertcache.sim.replay import ReplayResult, replay
from expertcache.trace.format import RoutingTrace
from expertcache.validation import check_int

Scope = Literal["layer", "global"]


class ApproximateReplayWarning(UserWarning):
    """A replay whose counts are only approximate for the trace it was built from."""


@dataclass(frozen=True)
class TraceCalls:
    """One pool's call stream.

    A stream is a value, like a `RoutingTrace`: frozen after its constructor checked it, and
    its sequences are tuples (each call one too) copied from the ones given, so the calls,
    forward starts and id counts a replay reads are the ones that were checked. To change a
    stream, make a new one with ``dataclasses.replace``, which checks again.

    Attributes:
        calls: distinct int keys of each call, in first-appearance order (a tuple of tuples;
            any sequence of sequences is accepted and copied).
        forward_starts: indices into ``calls`` where a forward pass starts (a tuple).
        num_keys: size of the key universe (``E`` per layer, ``L * E`` global).
        num_layers: layers sharing the pool (1 per layer, ``L`` global); key ``k`` is layer
            ``k // E``'s.
        num_ids: ids of each call as the runtime gets them (``T * K``, entries without a
            record included), a tuple; empty when not known.

    Raises:
        dataclasses.FrozenInstanceError: assigning or deleting a field after construction;
            AttributeError / TypeError: changing one of its tuples (``append``, item assignment).
    """

    calls: Sequence[Sequence[int]]
    forward_starts: Sequence[int]
    num_keys: int
    num_layers: int = 1
    num_ids: Sequence[int] = ()

    def __post_init__(self) -> None:
        """Copy the sequences into tuples, then refuse a layer count that cannot split the keys
        (a hand-built stream): each layer must own ``E = num_keys // num_layers >= 1`` keys, or
        `layer_of` divides by zero or files keys under the wrong layer.

        Raises:
            TypeError: ``num_keys`` or ``num_layers`` not an int, or ``calls``,
                ``forward_starts``, ``num_ids`` or a call not a sequence (a str, a number,
                an array of the wrong rank). ValueError:
                ``num_layers`` below 1, ``num_keys`` not a positive multiple of it, or
                ``num_ids`` neither empty nor one count per call.
        """
        if isinstance(self.calls, (str, bytes)) or not isinstance(self.calls, Iterable):
            raise TypeError(f"calls must be a sequence of calls, got a {type(self.calls).__name__}")
        calls = tuple(_frozen(f"calls[{index}]", call) for index, call in enumerate(self.calls))  # a 2-D array: rows
        object.__setattr__(self, "calls", calls)  # frozen: the constructor's one way in
        object.__setattr__(self, "forward_starts", _frozen("forward_starts", self.forward_starts))
        object.__setattr__(self, "num_ids", _frozen("num_ids", self.num_ids))
        num_layers = check_int("num_layers", self.num_layers, minimum=1)
        num_keys = check_int("num_keys", self.num_keys, minimum=1)
        if num_keys % num_layers:
            raise ValueError(
                f"num_keys must be a multiple of num_layers (E keys per layer), got {num_keys} keys for "
                f"{num_layers} layers"
            )
        if len(self.num_ids) not in (0, len(self.calls)):
            raise ValueError(
                f"num_ids must be empty or hold one count per call ({len(self.calls)}), got {len(self.num_ids)}"
            )

    @property
    def layer_of(self) -> Callable[[Hashable], int]:
        """The layer (``0 .. num_layers - 1``) of a key (an int here): ``key // E``."""
        experts = self.num_keys // self.num_layers
        return lambda key: int(key) // experts  # type: ignore[call-overload]

    @property
    def distinct_keys(self) -> int:
        """Keys used at least once (the compulsory misses of any cache)."""
        return len(set().union(*self.calls)) if self.calls else 0

    @property
    def lookups(self) -> int:
        return sum(len(call) for call in self.calls)


def _frozen(name: str, values: object) -> tuple:
    """``values`` as a tuple (itself if one already: no copy), a 1-D array's or tensor's
    items as Python ints, as `replay` counts them.

    Raises:
        TypeError: ``values`` not a sequence (a str or bytes, a number, an array not 1-D).
    """
    if isinstance(values, tuple):
        return values
    if isinstance(values, (np.ndarray, torch.Tensor)):
        if values.ndim != 1:
            raise TypeError(f"{name} must be a 1-D sequence, got a {values.ndim}-D {type(values).__name__}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence, got a {type(values).__name__}")
    return tuple(values)


def trace_calls(trace: RoutingTrace, *, scope: Scope) -> list[TraceCalls]:
    """The call streams of ``trace``: one per layer (``scope="layer"``) or one in all.

    Args:
        trace: ``expert_ids`` ``[N, L, K]`` int16/int32 (``-1`` = no record).
        scope: ``"layer"`` (a pool per layer) or ``"global"`` (one pool, all layers).

    Raises:
        TypeError: not a `RoutingTrace`. ValueError: an unknown scope, or a trace without
            a single record (nothing to replay).

    Warns:
        ApproximateReplayWarning: ``scope="global"`` on a trace of several layers whose rows
            are not aligned across layers (``trace.layers_aligned`` False).
    """
    return _calls_of(trace, scope, stacklevel=3)


def _calls_of(trace: RoutingTrace, scope: Scope, *, stacklevel: int) -> list[TraceCalls]:
    """`trace_calls`, its warning attributed ``stacklevel`` frames up (the user's call)."""
    if not isinstance(trace, RoutingTrace):
        raise TypeError(f"trace must be a RoutingTrace, got {type(trace).__name__}")
    if scope not in ("layer", "global"):
        raise ValueError(f"scope must be 'layer' or 'global', got {scope!r}")
    if trace.num_records == 0:
        source = f" ({trace.source})" if trace.source else ""
        raise ValueError(f"the trace{source} has no routing records ({trace.num_tokens} tokens): nothing to replay")
    if scope == "layer":
        return [_stream(trace, (column,)) for column in range(trace.num_layers)]
    if not trace.layers_aligned and trace.num_layers > 1:  # one layer: its pool is the global one
        warnings.warn(_unaligned_message(trace), ApproximateReplayWarning, stacklevel=stacklevel)
    return [_stream(trace, tuple(range(trace.num_layers)))]


def _unaligned_message(trace: RoutingTrace) -> str:
    source = f" ({trace.source})" if trace.source else ""
    return (
        f"the trace{source} has rows that are not aligned across layers (its notes: records lost, "
        "then renumbered per layer), so a global pool's calls mix tokens of different forward "
        "passes: its counts are approximate; per-layer replay (scope='layer') is exact"
    )


def _stream(trace: RoutingTrace, columns: Sequence[int]) -> TraceCalls:
    calls: list[tuple[int, ...]] = []
    forward_starts: list[int] = []
    num_ids: list[int] = []
    per_column = [trace.calls(column) for column in columns]
    for forward in zip(*per_column, strict=True):  # each column's call in one forward pass
        first = True
        for position, ids in enumerate(forward):
            keys = ids.reshape(-1).astype(np.int64)
            keys = keys[keys >= 0]
            if keys.size == 0:
                continue
            if first:
                forward_starts.append(len(calls))
                first = False
            calls.append(tuple(dict.fromkeys((keys + position * trace.num_experts).tolist())))
            num_ids.append(int(ids.size))
    return TraceCalls(calls, forward_starts, len(columns) * trace.num_experts, len(columns), num_ids)


def replay_streams(
    streams: Sequence[TraceCalls],
    *,
    policy: str | EvictionPolicy,
    capacity: int,
    oversize: Literal["passes", "overlapped", "raise"] = "passes",
    overlap_max_ids: int | None = None,
) -> ReplayResult:
    """Replay each stream with its own pool of ``capacity`` keys and add the counts.

    ``policy`` must be a name when there are several streams (each needs a fresh policy);
    ``oversize`` and ``overlap_max_ids`` as in `replay` (the streams' ``num_ids`` count a
    call's ids).

    Raises:
        TypeError: ``streams`` not a sequence of `TraceCalls` (one stream, a trace), before
            any replay. ValueError / TypeError: as `replay`.
    """
    streams = _checked_streams(streams)
    if isinstance(policy, EvictionPolicy) and len(streams) > 1:
        raise ValueError("give a policy name: every stream needs a fresh policy")
    if overlap_max_ids is not None and any(len(stream.num_ids) != len(stream.calls) for stream in streams):
        raise ValueError("overlap_max_ids needs the ids of every call: a stream without num_ids (see TraceCalls)")
    total = ReplayResult(0, 0, 0, 0)
    for stream in streams:
        total = total + replay(
            stream.calls,
            policy=policy,
            capacity=capacity,
            forward_starts=stream.forward_starts,
            num_layers=stream.num_layers,
            layer_of=stream.layer_of,
            oversize=oversize,
            overlap_max_ids=overlap_max_ids,
            num_ids=None if overlap_max_ids is None else stream.num_ids,
        )
    return total


def replay_trace(trace: RoutingTrace, *, policy: str | EvictionPolicy, capacity: int, scope: Scope) -> ReplayResult:
    """Replay ``trace`` with per-layer pools of ``capacity`` slots, or one global pool.

    Returns:
        Counts summed over layers (per layer) or of the one pool (global).

    Warns:
        ApproximateReplayWarning: as `trace_calls`.
    """
    return replay_streams(_calls_of(trace, scope, stacklevel=3), policy=policy, capacity=capacity)


def unbounded(streams: Sequence[TraceCalls]) -> ReplayResult:
    """An infinite cache: every key misses once (its first use), then always hits.

    Raises:
        TypeError: ``streams`` not a sequence of `TraceCalls`.
    """
    total = ReplayResult(0, 0, 0, 0)
    for stream in _checked_streams(streams):
        misses = stream.distinct_keys
        total = total + ReplayResult(stream.lookups - misses, misses, 0, len(stream.calls))
    return total


def _checked_streams(streams: object) -> list[TraceCalls]:
    """``streams`` as a list, each a `TraceCalls` (TypeError naming the first that is not)."""
    if isinstance(streams, (TraceCalls, RoutingTrace)) or not isinstance(streams, Iterable):
        raise TypeError(
            f"streams must be a sequence of TraceCalls (trace_calls(trace, scope=...)), got a {type(streams).__name__}"
            f"{': wrap one stream in a list' if isinstance(streams, TraceCalls) else ''}"
        )
    checked = list(streams)
    for index, stream in enumerate(checked):
        if not isinstance(stream, TraceCalls):
            raise TypeError(f"streams[{index}] is a {type(stream).__name__}, not a TraceCalls")
    return checked
