"""`CPUBackingStore`: every (local) expert of a layer in host memory, pinned on CUDA machines.

One host buffer holds one contiguous ``[E, *shape]`` region per registered tensor (see
`expertcache.layout`). Pinning goes through ``cudaHostRegister`` on that exactly sized
buffer instead of torch's caching host allocator, which rounds large requests up to a
power of two (a 604 MB request took 1027 MB in one report). The pin budget is checked
before anything is allocated (with compression, before the analysis pass too when even the
smallest possible records exceed it). The registration is *mapped*, so GPU kernels may read the
experts through their device address (the copy kernel does). Without CUDA the store is
plain memory and every code path still runs.

With ``compression="exponent"`` every bf16/fp16 name whose code pays is stored as
`expertcache.compression` records (``[E, record_bytes]`` in its region) instead of raw
bytes: the copy kernel's sibling (`expertcache.kernels.decode_copy`) decodes them into the
slots, so PCIe carries the coded bytes. The other names stay raw.

Lifetime: the buffer is unregistered and freed only after every CUDA device has finished
the work queued so far, so a copy still reading the store never reads freed memory
(`expertcache.pinned_host`, which also says why a store must not be released while another
thread captures a CUDA graph).

This module owns the store (its buffer, regions, pinning, filling) and the coding passes
that fill coded names (`encoding_device`, where they run). The checks of its coding
settings are `expertcache.store_checks` (`check_compression` importable from here too); its
tensors by name, coded ones decoded on access, `expertcache.stored_tensors`.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Mapping

import torch

from expertcache.errors import PinBudgetError
from expertcache.exponent_analysis import analyse
from expertcache.exponent_code import FLOAT16_FIELDS, ExponentCode, RecordFormat
from expertcache.exponent_decode import decode_records_torch as decode_records
from expertcache.exponent_records import write_records
from expertcache.layout import ExpertLayout, ExpertTensorSpec, layout_from_weights
from expertcache.pinned_host import flush_released, register, release
from expertcache.store_checks import check_coding_settings, check_compression
from expertcache.stored_tensors import StoredTensors, spec_named
from expertcache.validation import check_flag, check_int, check_pin_budget_bytes, resolve_device

__all__ = ["CPUBackingStore", "check_compression", "encoding_device"]

#: Stores coding more bytes than this show progress bars while they are encoded.
_PROGRESS_BYTES = 1 << 28


class CPUBackingStore:
    """Host copy of every expert of one layer.

    Args:
        layout: the registered tensors.
        weights: ``{name: [E, *shape]}`` on any device; copied in once.
        pin: register the buffer as pinned (page-locked, mapped) memory; needs CUDA.
        pin_budget_bytes: None (no limit) or bytes ``>= 0`` (any integer, numpy's too):
            refuse, before allocating anything, when the buffer would exceed it (checked on
            CPU-only machines too, where the store is plain memory). With compression the
            exact size is known after the analysis pass; a budget below the smallest size
            the records could have is refused before that pass runs.
        compression: ``None`` (raw bytes) or ``"exponent"`` (lossless exponent coding of the
            bf16/fp16 names; ``w1`` and ``w2`` must be bf16 or fp16).
        encode_device: where the coding passes run (`encoding_device`; default: the
            experts' GPU, else the current GPU when there is one, else the CPU). CPU
            experts move to the GPU a step (~16 M values) at a time; only the coded bytes
            come back, into the (already pinned) buffer. Every device writes the same bytes.
        progress: show a tqdm bar per coded name and pass (None: when the coded names
            exceed 256 MiB; the bar itself shows only on a terminal).

    Attributes:
        buffer: ``[buffer_bytes]`` uint8, the one allocation (pinned when ``pinned``).
        tensors: ``{name: [E, *shape]}``: contiguous typed views into ``buffer`` for raw
            names; for coded names a decoded copy, made on each access (slow: for restoring
            a model, not for serving).
        formats: ``{name: RecordFormat}`` of the coded names (empty without compression).
        records: ``{name: [E, record_bytes] uint8}`` views of the coded names' records.
        region_offsets: byte offset of each spec's region in ``buffer``.
    """

    def __init__(
        self,
        layout: ExpertLayout,
        weights: Mapping[str, torch.Tensor],
        *,
        pin: bool,
        pin_budget_bytes: int | None = None,
        compression: str | None = None,
        encode_device: torch.device | str | None = None,
        progress: bool | None = None,
    ) -> None:
        if not isinstance(layout, ExpertLayout):
            raise TypeError(f"layout must be an ExpertLayout (layout_from_weights), got {type(layout).__name__}")
        num_experts, given = layout_from_weights(weights)
        layout.check_compatible(given, what="weights", holder="the layout")  # copy_ would cast or broadcast
        check_flag("pin", pin)
        pin_budget_bytes = check_pin_budget_bytes(pin_budget_bytes)  # before any coding pass runs
        check_compression(compression, layout)
        check_coding_settings(compression, encode_device, progress)
        coder = _Coder(layout, weights, encode_device, progress) if compression else None
        if coder is not None and pin_budget_bytes is not None:  # refused before the (slow) analysis when
            least = layout.buffer_bytes(num_experts, coder.least_sizes())  # even the smallest records exceed it
            if least > pin_budget_bytes:
                raise PinBudgetError(least, pin_budget_bytes)
        analyses = coder.analyse() if coder else {}
        self.formats: dict[str, RecordFormat] = {name: analysis.format for name, analysis in analyses.items()}
        sizes = tuple(self.formats[s.name].record_bytes if s.name in self.formats else s.nbytes for s in layout.specs)
        nbytes = layout.buffer_bytes(num_experts, sizes)
        if pin_budget_bytes is not None and nbytes > pin_budget_bytes:
            raise PinBudgetError(nbytes, pin_budget_bytes)
        if pin and not torch.cuda.is_available():
            raise ValueError("pin=True needs CUDA; on a CPU-only machine the store is plain memory")
        self.layout = layout
        self.num_experts = num_experts
        self.compression = compression
        self.region_offsets = layout.region_offsets(num_experts, sizes)
        # outside inference mode (usable inside and outside it) and outside autograd (the
        # caller's tensors, parameters included, are copied, never referenced)
        with torch.inference_mode(False), torch.no_grad():
            self.buffer = torch.zeros(nbytes, dtype=torch.uint8)  # padding bytes deterministic
            self.pinned = False
            if pin:  # before filling: device -> host copies of records or GPU weights run at pinned speed
                flush_released()
                register(self.buffer)
                self.pinned = True
                weakref.finalize(self, release, self.buffer)  # also when filling fails below
            self.records: dict[str, torch.Tensor] = {}
            raw: dict[str, torch.Tensor] = {}
            for spec, offset, size in zip(layout.specs, self.region_offsets, sizes, strict=True):
                region = self.buffer[offset : offset + num_experts * size]
                if spec.name in analyses:
                    self.records[spec.name] = region.view(num_experts, size)
                    coder.write(spec.name, analyses[spec.name], self.records[spec.name])  # type: ignore[union-attr]
                else:
                    raw[spec.name] = region.view(spec.dtype).view(num_experts, *spec.shape)
                    raw[spec.name].copy_(weights[spec.name].detach())
            self.tensors: Mapping[str, torch.Tensor] = (
                StoredTensors(layout, raw, self.records, self.formats) if self.records else raw
            )

    @property
    def nbytes(self) -> int:
        """Bytes held (and pinned, when pinned): the regions and their alignment padding."""
        return self.buffer.nbytes

    @property
    def stored_expert_bytes(self) -> int:
        """Bytes of one expert as stored (records for coded names): what one miss reads from
        the host; ``layout.expert_bytes`` without compression."""
        return sum(self.formats[s.name].record_bytes if s.name in self.formats else s.nbytes for s in self.layout.specs)

    def spec(self, name: object) -> ExpertTensorSpec:
        """The registered tensor ``name``.

        Raises:
            KeyError: ``name`` is not registered (the message lists the names that are).
        """
        return spec_named(self.layout, name)

    def expert(self, name: str, index: int) -> torch.Tensor:
        """Expert ``index``'s tensor ``name`` ``[*shape]``: a view (raw) or a decoded copy (coded).

        Raises:
            KeyError: ``name`` is not registered. TypeError: ``index`` is not an int.
            ValueError: ``index`` is outside ``[0, num_experts)``.
        """
        spec = self.spec(name)
        index = check_int("index", index, minimum=0, maximum=self.num_experts - 1, expected="an int (expert index)")
        if name not in self.records:
            return self.tensors[name][index]
        return decode_records(self.records[name][index : index + 1], self.formats[name]).view(spec.shape)


def encoding_device(weights: Mapping[str, torch.Tensor], requested: torch.device | str | None = None) -> torch.device:
    """Where a store codes ``weights``: ``requested``; else the GPU ``w1`` is on; else the
    current GPU when this machine has one (the passes are vectorised torch: ~7 M values/s
    on a CPU core pair, a Qwen3-30B-A3B store's 7 G values would take over an hour); else
    the CPU.

    Raises:
        ValueError: ``requested`` is not the CPU or a CUDA device of this machine.
    """
    if requested is not None:
        return resolve_device(requested)
    if weights["w1"].is_cuda:
        return weights["w1"].device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Coder:
    """Runs the two coding passes of a store's bf16/fp16 names on one device, with bars."""

    def __init__(self, layout: ExpertLayout, weights: Mapping[str, torch.Tensor], device, progress) -> None:
        self.layout, self.weights = layout, weights
        self.device = encoding_device(weights, device)
        coded = sum(weights[s.name].nbytes for s in layout.specs if s.dtype in FLOAT16_FIELDS)
        self.progress = coded > _PROGRESS_BYTES if progress is None else progress

    def _label(self, what: str, name: str) -> str | None:
        return f"{what} {name} on {self.device}" if self.progress else None

    def _run(self, work):
        """``work()``, redone on the CPU if the GPU runs out of memory (a full GPU is what
        the cache is for); the bytes are the same either way."""
        try:
            return work()
        except torch.cuda.OutOfMemoryError:
            if self.device.type == "cpu":
                raise
            warnings.warn(f"out of memory coding the experts on {self.device}; coding on the CPU (slow)", stacklevel=3)
            self.device = torch.device("cpu")
            torch.cuda.empty_cache()
            return work()

    def least_sizes(self) -> tuple[int, ...]:
        """Bytes one expert of each spec takes in the store at least, known before `analyse`:
        a coded name's records reserve no second code and no exception byte at best, and a
        name whose records would not be smaller stays raw."""
        sizes = []
        for spec in self.layout.specs:
            least = spec.nbytes
            if spec.dtype in FLOAT16_FIELDS:
                values = math.prod(spec.shape)
                least = min(least, RecordFormat(ExponentCode(spec.dtype), values, capacity=0, spill=0).record_bytes)
            sizes.append(least)
        return tuple(sizes)

    def analyse(self) -> dict:
        """The first pass of every bf16/fp16 name whose records are smaller than its bytes."""
        out = {}
        for spec in self.layout.specs:
            if spec.dtype in FLOAT16_FIELDS:
                tensor, code = self.weights[spec.name], ExponentCode(spec.dtype)
                label = self._label("analysing", spec.name)
                analysis = self._run(lambda: analyse(tensor, code, progress=label, device=self.device))  # noqa: B023
                if analysis.format.pays():
                    out[spec.name] = analysis
        return out

    def write(self, name: str, analysis, out: torch.Tensor) -> None:
        """The second pass of ``name`` into its records ``out`` (host memory)."""
        label = self._label("encoding", name)
        self._run(lambda: write_records(self.weights[name], analysis, out, progress=label, device=self.device))
