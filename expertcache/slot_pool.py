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

`SlotPool` holds the state and the calls; its other methods live by idea beside it::

    expertcache.pool_layers     attach, the layers' key ranges, lookups by key (`PoolLayer`)
    expertcache.pool_prefetch   prefetch, check_prefetch, finish_prefetch (device mode)
    expertcache.pool_views      stats, prefetch_stats, expert_to_slot, expert_in
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Hashable, Mapping

import numpy as np
import torch

from expertcache import device_prepare, host_prepare, pool_layers, pool_prefetch, pool_views
from expertcache.call_guards import SingleCaller
from expertcache.kernels.slot_tables import SlotTables
from expertcache.layout import ExpertLayout, layout_from_weights
from expertcache.mover import MOVERS, POISON, CopyExpert, copy_pairs
from expertcache.policies import EvictionPolicy, make_policy
from expertcache.pool_layers import PoolLayer, check_attached
from expertcache.result import Landing
from expertcache.validation import (
    MAX_SLOTS,
    check_flag,
    check_int,
    check_mode_device,
    check_overlap,
    check_topk_ids,
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
        #: an overlapped call's (or a prefetch's) copies are on the copy stream, not yet joined
        #: (`expertcache.device_streams`)
        self.copies_pending = False
        #: an overlapped call still owes a pass whose slots it promised: its misses, or a pass
        #: whose copies are running (`expertcache.device_overlap`)
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

    # -- layers (`expertcache.pool_layers`) ----------------------------------------------------

    attach = pool_layers.attach
    floor = pool_layers.floor
    owner_of = pool_layers.owner_of
    store_of = pool_layers.store_of

    @property
    def share(self) -> int:
        """Keys one call or pass may hold, and slots every attached layer keeps:
        ``num_slots // layers`` (`expertcache.layer_shares`; all slots for one layer)."""
        return self.tables.share

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
        check_attached(self, layer)
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
        check_attached(self, layer)
        check_topk_ids(topk_ids, self.device)
        check_overlap(overlap)
        check_flag("landing", landing)
        if self.mode == "device":
            return self._started_by(device_prepare.passes(self, layer, topk_ids, overlap, landing))
        return self._started_by((ids, None) for ids in host_prepare.passes(self, layer, topk_ids, overlap))

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

    # -- prefetch, device mode (`expertcache.pool_prefetch`) -----------------------------------

    prefetch = pool_prefetch.prefetch
    check_prefetch = pool_prefetch.check_prefetch
    finish_prefetch = pool_prefetch.finish_prefetch

    # -- read-only views (`expertcache.pool_views`; they read the device tables: call them
    # outside CUDA graphs) ----------------------------------------------------------------------

    stats = pool_views.stats
    prefetch_stats = pool_views.prefetch_stats
    expert_to_slot = pool_views.expert_to_slot
    expert_in = pool_views.expert_in


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
