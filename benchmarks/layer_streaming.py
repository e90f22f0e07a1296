"""Static whole-layer streaming with prefetch ``depth`` layers ahead: the offloader baseline.

What vLLM's prefetch weight offloader does (PRs #29941, #51710), for MoE expert weights:
every expert of every layer lives in pinned host memory, ``depth + 1`` GPU layer buffers
form a ring, and while layer ``l`` computes, the copy engine streams layer ``l + depth``
into the buffer that layer ``l - 1`` has just finished with. No routing is consulted: every
expert of every layer crosses PCIe once per step, so a step can be no faster than

    max(compute of the step, L * E * expert bytes / pinned host -> GPU bandwidth)

(~14.5 GB, ~0.28 s per step for 12 Qwen3-30B-A3B layers at ~51 GB/s), whatever the batch.

Schedule of one step (``B = depth + 1`` buffers, layer ``l`` in buffer ``l % B``)::

    prepare(0)      side waits for current (fork; the previous step's reads are done)
                    side: copy layers 0 .. depth-1, event copied[l] after each
    prepare(l)      current waits copied[l]                      (layer l's weights landed)
                    current records freed  (layer l-1's compute is enqueued before it)
                    side waits freed; side: copy layer l+depth into buffer (l+depth) % B,
                    which is (l-1) % B: the buffer layer l-1 read; event copied[l+depth]
    prepare(L-1)    current waits for side (join: a CUDA graph capture ends joined)

Every event a step waits on is recorded in that same step, so the whole step, copies
included, is captured once in a CUDA graph and replays correctly with any routing. Each
step starts by copying layers 0 .. depth-1 again (simple and correct; carrying them over
from the previous step's tail would need buffers that outlive the step). On a CPU there are
no streams: the same copies run in order, so the ring logic is testable anywhere.

``StreamingLayers(stores, depth).providers`` are `ExpertWeightProvider` s, one per layer,
for `expertcache.decode_stack.DecodeStack`; they must be called in layer order each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from expertcache.provider import ExpertWeightProvider, result_from_tensors
from expertcache.result import ExpertWeightResult
from expertcache.store import CPUBackingStore
from expertcache.validation import check_topk_ids, resolve_device


class StreamingLayers:
    """A ring of ``depth + 1`` whole-layer GPU buffers fed from pinned host stores.

    Args:
        stores: one `CPUBackingStore` per layer, all with the same layout (pinned on CUDA).
        depth: layers copied ahead of the one computing, ``1 <= depth < len(stores)``.
        device: where the buffers live (default: the current CUDA device, else the CPU).

    Attributes:
        providers: one `ExpertWeightProvider` per layer; ``prepare(ids)`` of layer ``l``
            returns that layer's buffer (``[E, *shape]`` per name) and ``ids`` unchanged.
            The buffer holds layer ``l`` for the work enqueued on the current stream before
            the next ``prepare``, which overwrites it (with layer ``l + depth + 1``) after
            that work.
        buffers: ``depth + 1`` dicts ``{name: [E, *shape]}``, contiguous views of one uint8
            allocation each (a layer crosses PCIe as one copy of its store's buffer).

    One thread, one step at a time, layers in order; ``prepare`` of layer 0 starts a step.
    """

    def __init__(
        self, stores: Sequence[CPUBackingStore], depth: int, *, device: str | torch.device | None = None
    ) -> None:
        if not 1 <= depth < len(stores):
            raise ValueError(f"depth must be in [1, {len(stores) - 1}] for {len(stores)} layers, got {depth}")
        self.device = resolve_device(device)
        layout = stores[0].layout
        for index, store in enumerate(stores):
            layout.check_compatible(store.layout, what=f"layer {index}'s store")
            if self.device.type == "cuda" and not store.pinned:
                raise ValueError(f"layer {index}'s store is not pinned: a pageable copy cannot overlap or be captured")
        self.stores = list(stores)
        self.depth = depth
        self.num_experts = stores[0].num_experts
        self._raw = [torch.empty(stores[0].nbytes, dtype=torch.uint8, device=self.device) for _ in range(depth + 1)]
        self.buffers = [layout.views(raw, self.num_experts) for raw in self._raw]
        self._next_layer = 0
        cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if cuda else None
        self._copied = [torch.cuda.Event() for _ in stores] if cuda else []
        self._freed = torch.cuda.Event() if cuda else None
        self.providers = [StreamingLayerProvider(self, layer) for layer in range(len(stores))]

    @property
    def num_layers(self) -> int:
        return len(self.stores)

    @property
    def nbytes(self) -> int:
        """Device bytes of the layer buffers."""
        return sum(raw.nbytes for raw in self._raw)

    @property
    def bytes_per_step(self) -> int:
        """Host -> GPU bytes of one step: every layer's store, once. (No counters: a CUDA
        graph replay runs no Python, so counting calls would miss every replayed step.)"""
        return sum(store.nbytes for store in self.stores)

    def buffer_of(self, layer: int) -> int:
        """The ring buffer that holds ``layer`` while it computes."""
        return layer % (self.depth + 1)

    def prepare(self, layer: int, topk_ids: torch.Tensor) -> ExpertWeightResult:
        """Wait for ``layer``'s weights, prefetch ``layer + depth``, return ``layer``'s buffer."""
        check_topk_ids(topk_ids, self.device)
        if layer != 0 and layer != self._next_layer:
            raise RuntimeError(f"layers run in order each step: expected layer {self._next_layer}, got {layer}")
        if layer == 0:
            self._start_step()
        self._wait_copied(layer)
        if layer + self.depth < self.num_layers:
            self._prefetch(layer + self.depth, after_compute=True)
        if layer == self.num_layers - 1 and self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)  # join
        self._next_layer = (layer + 1) % self.num_layers
        return result_from_tensors(self.buffers[self.buffer_of(layer)], topk_ids.contiguous())

    def _start_step(self) -> None:
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))  # fork after the last step's reads
        for layer in range(self.depth):
            self._prefetch(layer, after_compute=False)

    def _prefetch(self, layer: int, *, after_compute: bool) -> None:
        target = self._raw[self.buffer_of(layer)]
        if self._side is None:
            target.copy_(self.stores[layer].buffer)
            return
        if after_compute:  # the buffer's last reader (layer - depth - 1) is enqueued on current
            self._freed.record(torch.cuda.current_stream(self.device))
            self._side.wait_event(self._freed)
        with torch.cuda.stream(self._side):
            target.copy_(self.stores[layer].buffer, non_blocking=True)
            self._copied[layer].record(self._side)

    def _wait_copied(self, layer: int) -> None:
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied[layer])


class StreamingLayerProvider(ExpertWeightProvider):
    """Layer ``layer`` of a `StreamingLayers` ring, as a weight provider."""

    def __init__(self, ring: StreamingLayers, layer: int) -> None:
        self.ring = ring
        self.layer = layer
        self.num_experts = ring.num_experts

    def prepare(self, topk_ids: torch.Tensor) -> ExpertWeightResult:
        return self.ring.prepare(self.layer, topk_ids)
