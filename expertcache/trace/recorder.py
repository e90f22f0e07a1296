"""`RoutingRecorder`: captures the router's choices of every MoE layer into a `RoutingTrace`.

An integration calls ``record(layer, topk_ids)`` once per MoE layer per forward pass (the
transformers integration does, when given a recorder). A forward pass ends when a layer
already recorded in it is seen again, so no framework hook is needed::

    forward 0: record(0, [T0, K]) record(1, [T0, K]) ...   -> tokens 0 .. T0-1
    forward 1: record(0, [T1, K]) ...                       -> tokens T0 .. T0+T1-1

``begin_request()`` marks where a new request (a new prompt) starts. ``trace()`` returns
everything so far as one `RoutingTrace` ([N, L, K] ids, int16 while they fit, -1 where a
layer was not called), which ``RoutingTrace.save`` writes as ``.npz``. Ids are checked when
they are recorded: integers in ``[-1, num_experts)`` (once the number of experts is known).

Threads: forward passes and requests are each thread's own, so several threads may run
forwards of a recorded model at once (see `RoutingRecorder`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from expertcache.trace.arrays import MAX_EXPERTS, first_repeat, whole_number
from expertcache.trace.format import RoutingTrace

_LAYER_LIMIT = 2**63 - 1


@dataclass
class _Forward:
    """One forward pass: each layer's ``[T, K]`` int32 ids, and whether it starts a request."""

    ids: dict[int, np.ndarray] = field(default_factory=dict)
    starts_request: bool = False


class RoutingRecorder:
    """Collects ``topk_ids`` per layer and per forward pass.

    Thread-safe: a lock guards the recorder, and each thread has its own forward pass in
    progress, so two threads running forwards of the recorded model at once never mix their
    records: each forward holds one thread's layers, and `begin_request` marks the calling
    thread's next forward. The trace lists forwards in the order they started (their first
    record). A forward a thread left open when it ended stays in the trace as it is.

    ``layers``, ``num_experts``, ``model`` and ``source`` are read-only properties, set by the
    constructor or (while unset) by `describe` once they pass its checks: assigning or
    deleting one raises AttributeError, since the records already taken were checked
    against them.

    Args:
        layers: model layer index of each MoE layer, in column order (an integration that
            knows them sets them through `describe` if not given here).
        num_experts: experts per layer ``E``.
        model: model name stored in the trace.
        source: where the trace comes from.
    """

    def __init__(
        self,
        *,
        layers: Sequence[int] | None = None,
        num_experts: int | None = None,
        model: str = "",
        source: str = "recorded by expertcache",
    ) -> None:
        self._layers: tuple[int, ...] | None = None if layers is None else _layer_tuple(layers)
        self._num_experts = None if num_experts is None else _experts(num_experts)
        if not isinstance(model, str) or not isinstance(source, str):
            raise TypeError("model and source must be str")
        self._model = model
        self._source = source
        self._forwards: list[_Forward] = []  # in the order they started, the open ones included
        self._thread = threading.local()  # .forward: the thread's open one; .request: its next starts one
        self._lock = threading.Lock()
        self._top_k: int | None = None
        self._largest_id = -1  # of every id recorded: `describe` must not give fewer experts

    @property
    def layers(self) -> tuple[int, ...] | None:
        """Model layer index of each MoE layer, in column order; None until known (read-only)."""
        return self._layers

    @property
    def num_experts(self) -> int | None:
        """Experts per layer ``E``; None until known (read-only)."""
        return self._num_experts

    @property
    def model(self) -> str:
        """Model name stored in the trace; "" until known (read-only)."""
        return self._model

    @property
    def source(self) -> str:
        """Where the trace comes from, stored in it (read-only)."""
        return self._source

    def describe(self, *, layers: Sequence[int], num_experts: int, model: str = "") -> None:
        """Fill in what the integration knows about the model (checked if already set).

        Raises:
            TypeError / ValueError: a bad field, one that disagrees with what was set, or
                fewer experts than an id already recorded; nothing changes.
        """
        layers = _layer_tuple(layers)
        num_experts = _experts(num_experts)
        if not isinstance(model, str):
            raise TypeError(f"model must be a str, got {type(model).__name__}")
        with self._lock:
            self._describe(layers, num_experts, model)

    def _describe(self, layers: tuple[int, ...], num_experts: int, model: str) -> None:
        if self._largest_id >= num_experts:
            raise ValueError(
                f"the recorder already recorded expert id {self._largest_id}; the model has {num_experts} experts"
            )
        if self.layers is not None and self.layers != layers:
            raise ValueError(f"recorder was set up for layers {self.layers}, the model has {layers}")
        if self.num_experts is not None and self.num_experts != num_experts:
            raise ValueError(f"recorder expects {self.num_experts} experts, the model has {num_experts}")
        self._layers, self._num_experts = layers, num_experts
        self._model = self._model or model

    @property
    def num_forwards(self) -> int:
        """Forward passes recorded so far (those in progress included)."""
        with self._lock:
            return len(self._forwards)

    def begin_request(self) -> None:
        """The calling thread's next forward pass starts a new request."""
        with self._lock:
            self._thread.forward = None
            self._thread.request = True

    def record(self, layer: int, topk_ids: torch.Tensor | np.ndarray) -> None:
        """Record one MoE layer's router choice.

        Args:
            layer: model layer index (one of ``layers``).
            topk_ids: ``[T, K]`` integer global expert ids (any device; copied to the host).

        Raises:
            TypeError: ``layer`` not an int, ids not integers, or a sparse tensor.
                ValueError: a ragged list, a tensor on the meta device, a layer not in
                ``layers``, ``K`` of 0, an id out of range or twice in one token's ids, or a
                top-k or token count that disagrees with the calls before; nothing is recorded.
        """
        layer = whole_number("layer", layer, minimum=0, maximum=_LAYER_LIMIT)
        if self.layers is None or layer not in self.layers:  # set once, never changed (describe)
            raise ValueError(f"layer {layer} is not one of the recorder's layers {self.layers}")
        ids = _host_ids(topk_ids)  # outside the lock: a copy from a GPU waits for it
        with self._lock:
            self._record(layer, ids)

    def _record(self, layer: int, ids: np.ndarray) -> None:
        if ids.dtype.kind not in "iu":
            raise TypeError(f"topk_ids must hold integer expert ids, got dtype {ids.dtype}")
        if ids.ndim < 2:
            raise ValueError(f"topk_ids must be [T, K], got shape {ids.shape}")
        if ids.shape[-1] == 0:
            raise ValueError(f"topk_ids must have at least one id per token (K >= 1), got shape {ids.shape}")
        ids = ids.reshape(-1, ids.shape[-1])
        limit = self.num_experts if self.num_experts is not None else MAX_EXPERTS
        if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= limit):
            raise ValueError(
                f"expert ids must be in [-1, {limit}), got values from {int(ids.min())} to {int(ids.max())}"
            )
        repeat = first_repeat(ids)
        if repeat is not None:
            raise ValueError(f"token {repeat[0]} of the call names expert {repeat[1]} twice (a top-k is distinct)")
        if self._top_k is not None and ids.shape[1] != self._top_k:
            raise ValueError(f"top-k changed from {self._top_k} to {ids.shape[1]} between calls")
        forward: _Forward | None = getattr(self._thread, "forward", None)
        if forward is not None and layer in forward.ids:  # the layer again: a new forward pass
            forward = None
        tokens = set() if forward is None else {other.shape[0] for other in forward.ids.values()}
        if tokens and tokens != {ids.shape[0]}:
            raise ValueError(
                f"layer {layer} routed {ids.shape[0]} tokens, the other layers of this forward pass {tokens.pop()}"
            )
        if forward is None:  # checks passed: only now does a new forward begin
            forward = _Forward(starts_request=getattr(self._thread, "request", False))
            self._forwards.append(forward)
            self._thread.forward, self._thread.request = forward, False
        self._top_k = ids.shape[1]
        self._largest_id = max(self._largest_id, int(ids.max()) if ids.size else -1)
        forward.ids[layer] = ids.astype(np.int32)

    def trace(self) -> RoutingTrace:
        """Everything recorded so far as a `RoutingTrace` (recording may continue after)."""
        with self._lock:
            return self._trace()

    def _trace(self) -> RoutingTrace:
        if self.layers is None or self.num_experts is None:
            raise ValueError("the recorder does not know the model's layers yet (see describe)")
        blocks, starts, total = [], [], 0
        request_tokens = set()
        for forward in self._forwards:
            block = self._forward_block(forward.ids)
            if forward.starts_request:
                request_tokens.add(total)
            if block.shape[0]:
                starts.append(total)
            blocks.append(block)
            total += block.shape[0]
        top_k = blocks[0].shape[2] if blocks else 0
        expert_ids = np.concatenate(blocks) if blocks else np.zeros((0, len(self.layers), top_k), np.int32)
        # a request whose forward passes have routed no token yet starts no token
        requests = sorted(request_tokens - {total})
        return RoutingTrace(
            expert_ids=expert_ids,
            forward_starts=np.array(starts, dtype=np.int64),
            request_starts=np.array(requests, dtype=np.int64),
            layers=np.array(self.layers, dtype=np.int64),
            num_experts=int(self.num_experts),
            model=self.model,
            source=self.source,
        )

    def _forward_block(self, forward: dict[int, np.ndarray]) -> np.ndarray:
        tokens, top_k = next(iter(forward.values())).shape
        assert self.layers is not None
        block = np.full((tokens, len(self.layers), top_k), -1, dtype=np.int32)
        for layer, ids in forward.items():
            block[:, self.layers.index(layer)] = ids
        return block


def _host_ids(topk_ids: object) -> np.ndarray:
    """``topk_ids`` as a numpy array on the host, or an error in the recorder's words."""
    if isinstance(topk_ids, torch.Tensor):
        if topk_ids.layout != torch.strided:
            raise TypeError(f"topk_ids must be a dense tensor, got layout {topk_ids.layout}")
        if topk_ids.device.type == "meta":
            raise ValueError("topk_ids is on the meta device: it holds no ids to record")
        return topk_ids.detach().cpu().numpy()
    try:
        return np.asarray(topk_ids)
    except (ValueError, TypeError) as error:  # a ragged list
        reason = str(error).split(". ")[0]
        raise ValueError(f"topk_ids must be a rectangular [T, K] array of integer ids ({reason})") from None


def _layer_tuple(layers: Sequence[int]) -> tuple[int, ...]:
    values = tuple(whole_number("a layer index", layer, minimum=0, maximum=_LAYER_LIMIT) for layer in layers)
    if len(set(values)) != len(values):
        raise ValueError(f"layers must be distinct, got {values}")
    return values


def _experts(num_experts: int) -> int:
    return whole_number("num_experts", num_experts, minimum=1, maximum=MAX_EXPERTS)
