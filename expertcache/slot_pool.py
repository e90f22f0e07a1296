"""`SlotPool`: fixed-address slot tensors on the device, the tables that say who holds them,
and ``prepare``, the one pipeline both modes run.

One pool serves one layer (a per-layer budget) or many (a global pool: layers own
consecutive key ranges, hot layers borrow the slots cold ones leave idle, and every layer
keeps its share, ``S // L``: `expertcache.layer_shares`). Everything is allocated once and never
moves, so CUDA graphs and engines may keep the addresses::

    tensors  {name: [S, *shape]}         contiguous slot tensors, one allocation each: what kernels read
    tables   `SlotTables`                expert <-> slot, counters, plan: the only state

``prepare(layer, topk_ids)`` = plan, move, commit + remap (``passes``: the same per
expert-group pass, for calls of more experts than slots)::

    host mode    ids and tables read on the host (one sync) -> any policy plans (call_plan)
                 -> copy engine moves -> commit kernel applies the plan, counts, remaps
    device mode  LRU admission kernel plans, commits, remaps -> copy kernel moves
                 (an eager prefill: the plan read back, the copy engine moves)

The modes differ in who fills the plan; the tables, the copy kernel, the remap lookup and
every read-only view are shared. A call either completes or leaves the pool exactly as it
was (`expertcache.host_prepare`, `expertcache.device_prepare`). Free slots hold 0xFF bytes.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Generator, Hashable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from expertcache import device_prepare, host_prepare
from expertcache.call_guards import SingleCaller
from expertcache.kernels.slot_tables import COUNTERS, SlotTables
from expertcache.layer_shares import LayerFloor, layer_share
from expertcache.layout import ExpertLayout, layout_from_weights
from expertcache.mover import MOVERS, POISON, CopyExpert, CopyGroup, DecodeGroup, copy_groups, copy_pairs
from expertcache.policies import EvictionPolicy, claim_policy, make_policy
from expertcache.result import Landing
from expertcache.stats import CacheStats
from expertcache.store import CPUBackingStore
from expertcache.validation import (
    MAX_SLOTS,
    check_expert_map,
    check_flag,
    check_int,
    check_mode_device,
    check_overlap,
    check_topk_ids,
    is_dense,
    resolve_device,
)

MODES = ("host", "device")

#: CUDA priority of a pool's copy stream (lower is higher; torch clamps it to the device's
#: range). A layer's admissions and copies are its critical path: when they contend with the
#: apply for SMs they should go first. Kernels keep it inside CUDA graphs (PyTorch
#: instantiates graphs with per-node priorities). 0: the default priority (an ablation).
#: Measured on raw per-layer device caches at batch 4-16 only (benchmarks/README.md, run 51).
COPY_STREAM_PRIORITY = -1

_Pass = tuple[torch.Tensor, "Landing | None"]  # a pass's slot ids, and its landing counters


@dataclass(frozen=True)
class PoolLayer:
    """One attached layer: its store, its key range, its id map, its copy segments."""

    name: Hashable
    index: int
    key_offset: int
    store: CPUBackingStore
    num_global: int
    global_to_local: torch.Tensor | None  # [E_global] int32 on the pool's device; None = identity
    global_to_local_host: np.ndarray  # [E_global] int64
    copy_groups: tuple[CopyGroup | DecodeGroup, ...]  # how the copy (and decode) kernels move one expert

    @property
    def num_experts(self) -> int:
        return self.store.num_experts


class SlotPool:
    """Slot tensors on one device, filled by host-mode or device-mode admission.

    Args:
        layout: the registered tensors (every attached layer must match): an `ExpertLayout`
            (`for_weights` derives it from a ``{name: [E, ...]}`` dict of weights).
        num_slots: ``S``, an integer (numpy's too, never a bool) of at least 1.
        device: where the slots live (default: the current CUDA device, else the CPU).
        policy: eviction policy name or a fresh instance (host mode); device mode is LRU.
        mode: ``"host"`` (default) or ``"device"``.
        mover: how misses are moved, ``"engine"`` (default) or ``"kernel"``. Host mode: the
            copy engine, or the copy kernel from the uploaded plan. Device mode plans on the
            GPU and copies with the kernel; ``"engine"`` applies only to its eager
            prefills (passes one after the other of more than ``OVERLAP_MAX_IDS`` ids that
            may need more experts than the share): each pass's plan is read back (one sync
            a pass) and the engine copies, at its faster rate. Everything else (inside CUDA
            graphs and ``torch.compile`` too) copies with the kernel.

    Attach every layer before the first ``prepare``. A pool serves one thread at a time;
    a result's slot tensors hold its experts until the pool's next ``prepare``.
    """

    def __init__(
        self,
        layout: ExpertLayout,
        num_slots: int,
        *,
        device: str | torch.device | None = None,
        policy: str | EvictionPolicy = "lru",
        mode: str = "host",
        mover: str | None = None,
    ) -> None:
        if not isinstance(layout, ExpertLayout):
            given = f"the class {layout.__name__}" if isinstance(layout, type) else type(layout).__name__
            raise TypeError(
                f"layout must be an ExpertLayout, got {given}; for a pool of experts shaped like a "
                "{name: [E, ...]} dict of weights use SlotPool.for_weights(weights, num_slots)"
            )
        num_slots = check_int("num_slots", num_slots, minimum=1, maximum=MAX_SLOTS)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mover not in (None, *MOVERS):
            raise ValueError(f"mover must be one of {MOVERS}, got {mover!r}")
        self.layout = layout
        self.device = resolve_device(device)
        self.mode = mode
        self.mover = mover or "engine"
        if mode == "device" or self.mover == "kernel":
            check_mode_device(self.device)
        if mode == "device":
            device_prepare.check_device_policy(policy)
        chosen = None if mode == "device" else _host_policy(policy, num_slots)
        with torch.inference_mode(False):  # in-place updates must work inside and outside it
            self.tensors = layout.allocate(num_slots, self.device, POISON)
        self.num_slots = num_slots
        self.tables = SlotTables.allocate(0, num_slots, 0, self.device)
        self.layers: dict[Hashable, PoolLayer] = {}
        self.ordered_layers: list[PoolLayer] = []  # by index; their key ranges are consecutive
        self._key_offsets: list[int] = []
        #: ``[num_keys]`` int32 on the device, the layer of each key (a pool of several layers)
        self.key_layer: torch.Tensor | None = None
        self._key_layer_host = np.zeros(0, dtype=np.int32)
        self._started = False
        self.guard = SingleCaller("this slot pool")
        #: How the copy engine moves one expert; replaced only to pace copies
        #: (`expertcache.parallel.pacing`), never to change what lands.
        self.copy_expert: CopyExpert = copy_pairs
        self.forward = host_prepare.ForwardTracker()
        #: calls (and passes) begun on this pool: a multi-pass call knows whether another ran between its
        #: passes (host mode then reads the state again; an overlapped device call refuses to go on)
        self.calls_begun = 0
        self.backup: torch.Tensor | None = None  # device mode: the state before the call in flight
        with torch.inference_mode(False):
            self.no_passes = torch.empty(0, dtype=torch.int32, device=self.device)  # a call of one pass
        self.op_id = device_prepare.register(self)
        self._copy_stream: torch.cuda.Stream | None = None
        #: an overlapped call's copies are on the copy stream, not yet joined (device_prepare)
        self.copies_pending = False
        #: an overlapped call still owes a pass whose slots it promised: its misses, or a pass
        #: whose copies are running (device_prepare)
        self.passes_owed = False
        #: what the copy stream still reads (a prefetch's ids): alive until the next call joins it
        self.copy_inputs: tuple[torch.Tensor, ...] = ()
        self.policy = chosen  # claimed by the first attach, so a pool that never serves binds nothing

    @classmethod
    def for_weights(cls, weights: Mapping[str, torch.Tensor], num_slots: int, **kwargs) -> SlotPool:
        """A pool whose slots fit experts shaped like ``weights`` (``{name: [E, ...]}``)."""
        return cls(layout_from_weights(weights)[1], num_slots, **kwargs)

    @property
    def nbytes(self) -> int:
        """Device bytes of the slot tensors."""
        return sum(tensor.nbytes for tensor in self.tensors.values())

    # -- layers ------------------------------------------------------------------------------

    def attach(self, name: Hashable, store: CPUBackingStore, global_to_local: torch.Tensor) -> PoolLayer:
        """Serve layer ``name``'s experts from ``store``.

        Args:
            name: any hashable, unique in this pool.
            store: the layer's experts (the pool's layout).
            global_to_local: ``[E_global]`` int32/int64 map, global id -> local expert or -1,
                every local expert exactly once (`expertcache.validation.check_expert_map`).
        """
        if not isinstance(store, CPUBackingStore):
            raise TypeError(f"store must be a CPUBackingStore, got {type(store).__name__}")
        if not isinstance(global_to_local, torch.Tensor):
            raise TypeError(f"global_to_local must be a tensor, got {type(global_to_local).__name__}")
        if self._started:
            raise RuntimeError("attach every layer to a slot pool before its first prepare()")
        try:
            hash(name)
        except TypeError:
            raise TypeError(
                f"a layer name must be hashable (a dict key), got {type(name).__name__} {name!r:.40}"
            ) from None
        global_to_local = check_expert_map(global_to_local, store.num_experts, name="global_to_local")
        if name in self.layers:
            raise ValueError(f"layer {name!r} is already attached to this slot pool")
        layer_share(self.num_slots, len(self.layers) + 1)  # raises: more layers than slots
        self.layout.check_compatible(store.layout, what=f"layer {name!r}")
        if self.device.type == "cuda" and not store.pinned:
            raise ValueError("a store served to a GPU pool must be pinned (build it with pin=True)")
        key_offset = self.tables.num_keys
        host_map = global_to_local.to(torch.int64).numpy()
        identity = np.array_equal(host_map, np.arange(store.num_experts))
        layer = PoolLayer(
            name, len(self.layers), key_offset, store, int(host_map.size),
            None if identity else global_to_local.to(self.device, torch.int32), host_map,
            copy_groups(store, self.device),
        )  # fmt: skip
        tables = SlotTables.allocate(key_offset + store.num_experts, self.num_slots, len(self.layers) + 1, self.device)
        ordered = [*self.ordered_layers, layer]
        key_layer_host = np.concatenate([np.full(entry.num_experts, entry.index, dtype=np.int32) for entry in ordered])
        key_layer = self.key_layer
        if len(ordered) > 1:
            with torch.inference_mode(False):
                key_layer = torch.from_numpy(key_layer_host).to(self.device)
        if self.policy is not None and not self.layers:  # the first layer binds the policy, once nothing can fail
            claim_policy(self.policy, capacity=self.num_slots, owner=self)
        self.tables, self.key_layer, self._key_layer_host = tables, key_layer, key_layer_host
        self.layers[name] = layer
        self.ordered_layers.append(layer)
        self._key_offsets.append(key_offset)
        return layer

    def _check_attached(self, layer: object) -> None:
        """Every method taking a ``layer`` serves only this pool's own (`attach`'s answer):
        another pool's layer would read or write this pool's rows of the same index."""
        if not isinstance(layer, PoolLayer):
            raise TypeError(f"layer must be a PoolLayer from attach() (provider.layer), got {type(layer).__name__}")
        if self.layers.get(layer.name) is not layer:
            raise ValueError(f"layer {layer.name!r} is not attached to this slot pool")

    @property
    def share(self) -> int:
        """Keys one call or pass may hold, and slots every attached layer keeps:
        ``num_slots // layers`` (`expertcache.layer_shares`; all slots for one layer)."""
        return self.tables.share

    def floor(self, layer: PoolLayer, expert_to_slot: np.ndarray) -> LayerFloor | None:
        """What a call of ``layer`` may not take from the other layers (None: a pool of one
        layer), given ``expert_to_slot`` now (a host copy)."""
        if len(self.layers) < 2:
            return None
        held = np.bincount(self._key_layer_host[expert_to_slot >= 0], minlength=len(self.layers))
        return LayerFloor(layer.index, self.share, held.tolist(), self._layer_of_key)

    def _layer_of_key(self, key: object) -> int:
        """The layer index of a key, -1 for anything that is no key of the pool (a policy's
        bad victim, refused by the planner)."""
        row = host_prepare.key_row(key, self._key_layer_host.size)
        return -1 if row < 0 else int(self._key_layer_host[row])

    def owner_of(self, key: object) -> tuple[PoolLayer, int]:
        """``(layer, local expert)`` of a key."""
        index = bisect.bisect_right(self._key_offsets, int(key)) - 1  # type: ignore[call-overload]
        layer = self.ordered_layers[index]
        return layer, int(key) - layer.key_offset  # type: ignore[call-overload]

    def store_of(self, key: object) -> tuple[CPUBackingStore, int]:
        """``(store, row)`` holding a key's expert."""
        layer, expert = self.owner_of(key)
        return layer.store, expert

    # -- the call ----------------------------------------------------------------------------

    def prepare(self, layer: PoolLayer, topk_ids: torch.Tensor) -> torch.Tensor:
        """Make every local expert of ``topk_ids`` resident; return the ids remapped to slots.

        Args:
            layer: an attached layer (from `attach`).
            topk_ids: ``[T, K]`` int32/int64 global expert ids on the pool's device.

        Returns:
            ``[T, K]`` contiguous, ``topk_ids``' dtype: slot ids, -1 for experts of other ranks
            (and, in device mode, for ids outside ``[0, E_global)``, counted in ``invalid_ids``).
            The slots hold these experts until this pool's next ``prepare``.

        Raises:
            TypeError / ValueError / IndexError: bad ids (dtype, shape, device; range in host
                mode, and in device mode whenever the call is read on the host).
            CacheCapacityError: more distinct local experts than `share` (the slots, for a
                pool of one layer).
            ConcurrentUseError: another thread is inside this pool.
            In every case the pool is left exactly as it was.
        """
        self._check_attached(layer)
        check_topk_ids(topk_ids, self.device)
        run = device_prepare.prepare if self.mode == "device" else host_prepare.prepare
        slot_ids = run(self, layer, topk_ids)
        self._started = True  # the tables now hold state: they keep their addresses
        return slot_ids

    def passes(
        self, layer: PoolLayer, topk_ids: torch.Tensor, *, overlap: bool = False, landing: bool = False
    ) -> Generator[tuple[torch.Tensor, Landing | None]]:
        """Serve a call of any size in expert-group passes (`expertcache.passes`).

        Args:
            layer, topk_ids: as in `prepare` (checked before this returns).
            overlap: the caller sums passes exactly (as `expertcache.kernels.moe_apply_passes`
                does). A call that does not fit then runs in overlapped passes, groups of
                half the share (`expertcache.passes`), in every mode. A device-mode pool that
                cannot hold every expert of the layer admits and copies on its copy stream:
                each pass's copies run while the pass before computes, and the first pass
                comes as two, its hits at once (computed while its misses are copied), then
                its misses. Device mode under ``torch.compile`` (no streams in a traced op)
                serves the call as without overlap.
            landing: the caller's kernel waits on `expertcache.result.Landing` counters
                (`expertcache.kernels.landing`): an overlapped device-mode call then hands
                its copied passes over once admitted, with their counters, instead of once
                copied, inside a CUDA graph capture on sm_90+ (programmatic launch on) and
                under the interpreter. Elsewhere (host mode, decoded stores, eager GPU
                calls, a call that is not overlapped) the passes come without counters,
                every slot filled as without ``landing``.

        Returns:
            An iterator of ``(slot ids, landing)``, one per pass. Slot ids are ``[T, K]``:
            this pass's ids remapped, -1 for the ids of other passes (and for other ranks'
            experts); ``landing`` is the pass's `Landing` counters or None. Host mode takes
            ``ceil(distinct experts / G)`` passes (``G`` keys a group); device mode always
            `expertcache.passes.max_passes` (no sync; the unneeded ones are empty), one more
            when the first pass is split (hits, then misses). Each pass is atomic: an error
            leaves the pool as it was before that pass. A pass's slots hold its experts
            until the next pass (or ``prepare``) on this pool. Another call on the pool
            between two passes (another layer's, say) makes host mode read the state again;
            an overlapped device-mode call, which admits a pass ahead, raises `RuntimeError`
            instead of yielding slots that call may have taken. Closing the iterator early
            (``close()``, or an error in the caller's loop) ends the call there and then: a
            device-mode pool joins its copy stream before ``close()`` returns.
        """
        self._check_attached(layer)
        check_topk_ids(topk_ids, self.device)
        check_overlap(overlap)
        check_flag("landing", landing)
        if self.mode == "device":
            return self._started_by(device_prepare.passes(self, layer, topk_ids, overlap, landing))
        return self._started_by((ids, None) for ids in host_prepare.passes(self, layer, topk_ids, overlap))

    def prefetch(self, layer: PoolLayer, expert_ids: torch.Tensor) -> None:
        """Start loading experts a predictor expects ``layer`` to need (device mode).

        Args:
            layer: an attached layer, the only one of this pool.
            expert_ids: ``[N]`` or ``[T, K]`` int32/int64 global ids on the pool's device, at
                most ``num_slots`` of them, duplicates and -1 included (ids outside
                ``[0, E_global)`` and other ranks' experts are skipped; the first count in
                ``prefetch_stats.invalid_ids``). Leave it unchanged until the layer's next call.

        Admission and copies run on the pool's copy stream, after what the current stream
        holds, and the call returns at once: the copies overlap whatever the current stream
        runs next (another layer's compute). The pool's next ``prepare`` or ``passes`` waits
        for them (inside a CUDA graph: call it before the capture ends). Like a call, a
        prefetch may overwrite the slots of the pool's last result: enqueue the kernels that
        read it first. Prefetched experts count as used now for LRU; the counts go to
        `prefetch_stats`, not `stats`.

        Raises:
            TypeError / ValueError: ids of the wrong type, dtype, shape or device, more ids
                than slots.
            ValueError: host mode, a pool shared by several layers (its copies could overwrite
                slots another layer's kernels are reading).
            RuntimeError: an overlapped call of this pool still owes its misses pass (its
                slots are promised), or under ``torch.compile`` (a side stream).
            In every case the pool is left as it was.
        """
        expert_ids = self.check_prefetch(layer, expert_ids)
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "prefetch enqueues on a side stream and cannot be compiled; call it outside the compiled region"
            )
        device_prepare.prefetch(self, layer, expert_ids)
        self._started = True

    def finish_prefetch(self, layer: PoolLayer) -> None:
        """Make the current stream wait for the copies ``layer``'s prefetches still run on the
        pool's copy stream (a no-op when none does, and in host mode).

        The layer's next call joins them by itself; call this when that call lies outside
        the CUDA graph being captured (a prefetch for the next step's graph), which must
        join its side streams before the capture ends. Capturable; syncs nothing.
        """
        self._check_attached(layer)
        with self.guard:
            device_prepare.join_copies(self)

    def check_prefetch(self, layer: PoolLayer, expert_ids: torch.Tensor) -> torch.Tensor:
        """Raise as `prefetch` would for ``expert_ids``, changing nothing; return them as ``[1, N]``.

        A caller that prefetches for several layers in one step (`DecodeStack`) checks them
        all before the first layer runs.
        """
        self._check_attached(layer)
        if self.mode != "device":
            raise ValueError("prefetch needs mode='device' (host mode plans on the host: it would sync)")
        if len(self.layers) != 1:
            raise ValueError(
                f"prefetch needs a pool of one layer; this one serves {len(self.layers)}, and a prefetch "
                "could overwrite slots another layer's kernels are still reading"
            )
        if isinstance(expert_ids, torch.Tensor) and is_dense(expert_ids):
            if expert_ids.dim() not in (1, 2):
                raise ValueError(f"expert_ids must be 1-D [N] or 2-D [T, K] ids, got shape {tuple(expert_ids.shape)}")
            expert_ids = expert_ids.reshape(1, -1)
        check_topk_ids(expert_ids, self.device, name="expert_ids")
        if expert_ids.numel() > self.num_slots:
            raise ValueError(f"prefetch at most num_slots={self.num_slots} ids at once, got {expert_ids.numel()}")
        if self.passes_owed:
            raise RuntimeError(
                "an overlapped call of this pool has yet to yield a pass whose slots a prefetch could "
                "overwrite: take its passes (or close its generator) first"
            )
        return expert_ids.reshape(1, -1).contiguous()

    def prefetch_stats(self, layer: PoolLayer) -> CacheStats:
        """Counts of ``layer``'s prefetches: ``hits`` already resident, ``misses`` copied."""
        self._check_attached(layer)
        self._settled()
        row = dict(zip(COUNTERS, self.tables.prefetched[layer.index].tolist(), strict=True))
        raw, stored = self.layout.expert_bytes, layer.store.stored_expert_bytes
        return CacheStats(**row, bytes_h2d=row["misses"] * raw, compressed_bytes_h2d=row["misses"] * stored)

    def copy_stream(self) -> torch.cuda.Stream | None:
        """The side stream device-mode copies overlap on (``passes(..., overlap=True)``);
        None on the CPU, where launches run in order."""
        if self.device.type != "cuda":
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device, priority=COPY_STREAM_PRIORITY)
        return self._copy_stream

    def _started_by(self, passes: Generator[_Pass]) -> Generator[_Pass]:
        with contextlib.closing(passes):  # a caller's close() reaches the passes at once, not at collection
            for served in passes:
                self._started = True
                yield served

    # -- read-only views (they read the device tables: call them outside CUDA graphs) -------

    def _settled(self) -> SlotTables:
        """The tables, once the current stream has waited for copies still pending on the
        copy stream (a prefetch's admission writes them there). They stay pending: the pool's
        next call joins them on its own stream, whichever thread read the view."""
        device_prepare.wait_for_copies(self)
        return self.tables

    def stats(self, layer: PoolLayer) -> CacheStats:
        """Exact counters of ``layer``."""
        self._check_attached(layer)
        self._settled()
        row = dict(zip(COUNTERS, self.tables.counters[layer.index].tolist(), strict=True))
        raw, stored = self.layout.expert_bytes, layer.store.stored_expert_bytes
        return CacheStats(**row, bytes_h2d=row["misses"] * raw, compressed_bytes_h2d=row["misses"] * stored)

    def expert_to_slot(self, layer: PoolLayer) -> np.ndarray:
        """``[E_local]`` int32 copy: the slot of each of ``layer``'s experts, or -1."""
        self._check_attached(layer)
        start = layer.key_offset
        return self._settled().expert_to_slot[start : start + layer.num_experts].cpu().numpy().copy()

    def expert_in(self, layer: PoolLayer, slot: int) -> int:
        """Local expert of ``layer`` held by ``slot`` (an int in ``[0, num_slots)``), or -1
        (free, or another layer's)."""
        self._check_attached(layer)
        slot = check_int("slot", slot, minimum=0, maximum=self.num_slots - 1)
        key = int(self._settled().slot_to_key[slot])
        if key < 0:
            return -1
        owner, expert = self.owner_of(key)
        return expert if owner is layer else -1


def _host_policy(policy: str | EvictionPolicy, num_slots: int) -> EvictionPolicy:
    chosen = make_policy(policy, capacity=num_slots)
    if chosen.capacity != num_slots:
        raise ValueError(
            f"the {chosen.name!r} policy instance was built for capacity {chosen.capacity}, not {num_slots}"
        )
    if chosen.clairvoyant:
        raise ValueError(
            f"policy {chosen.name!r} needs to know the future: it is for simulation (expertcache.sim.replay) only"
        )
    return chosen
