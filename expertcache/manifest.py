"""Manifest: what an expert cache registered and what it really allocated, as JSON.

Built from the live objects, not from arithmetic on the configuration: the slot pool's
bytes are the size of its GPU buffer's storage, the host bytes the size of each backing
store's buffer (pinned ones counted as pinned), so the manifest shows what the
process holds. One provider gives a layer's manifest; several (a model) give the sum,
each shared pool and each store shared by several layers counted once::

    {"tensors": [{"name", "shape", "dtype", "bytes"}], "layers", "experts", "expert_bytes",
     "num_slots", "pool_gpu_bytes", "host_bytes", "pinned_host_bytes",
     "full_residency_gpu_bytes", "gpu_bytes_freed", "device",
     "compression", "compressed_expert_bytes"}

With a compressed store (``compression="exponent"``) ``host_bytes`` is the coded buffer's
size and ``compressed_expert_bytes`` what one miss reads over PCIe; ``expert_bytes`` stays
what lands in a slot. Both fields are optional when read (older manifests: raw).

`Manifest.read` refuses, naming the file and the field, a manifest whose fields are of the
wrong type, out of range or disagree with each other (`expertcache.manifest_checks` lists
every check). `Manifest.write` refuses, before writing, a manifest that `Manifest.read`
would refuse.

``expertcache plan --manifest FILE`` reads ``expert_bytes`` (the bytes one miss copies and
one slot holds) from it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expertcache.file_writes import write_files
from expertcache.manifest_checks import check_entry, check_manifest

if TYPE_CHECKING:
    from expertcache.cached_provider import CachedWeightProvider

MANIFEST_VERSION = 2

#: The most bytes one expert can have (1 TiB): the experts of today's largest MoE models are
#: below a few GB, so a larger figure is a mistake (a unit, a damaged file), not a model.
MAX_EXPERT_BYTES = 2**40

#: The most layers, and experts over all layers, a manifest can count: expert ids are int32
#: (as a trace's, `expertcache.trace.arrays.MAX_EXPERTS`); a larger figure is damage.
MAX_COUNT = 2**31 - 1


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One registered per-expert tensor: ``shape`` and ``bytes`` are of one expert."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int


@dataclass(frozen=True)
class Manifest:
    """Registered tensors, slots and bytes of one or more cached layers.

    Attributes:
        tensors: the per-expert tensors every layer registers.
        layers: cached layers covered.
        experts: experts summed over those layers (local experts under EP).
        expert_bytes: bytes of one expert (all its tensors): what one miss copies, one slot holds.
        num_slots: slots of the distinct pools.
        pool_gpu_bytes: bytes of the distinct pools' slot buffers.
        host_bytes: bytes of the backing stores' buffers (a store several layers share once).
        pinned_host_bytes: the part of ``host_bytes`` that is pinned (page-locked).
        full_residency_gpu_bytes: bytes the same experts take fully resident (unpadded).
        gpu_bytes_freed: ``full_residency_gpu_bytes - pool_gpu_bytes`` (negative if larger).
        device: the pools' device.
        compression: the stores' compression (None: raw bytes).
        compressed_expert_bytes: bytes one expert takes in the store, summed over its
            tensors (what one miss reads from the host); ``expert_bytes`` when raw, the
            mean over the layers when their records differ.
    """

    tensors: tuple[TensorEntry, ...]
    layers: int
    experts: int
    expert_bytes: int
    num_slots: int
    pool_gpu_bytes: int
    host_bytes: int
    pinned_host_bytes: int
    full_residency_gpu_bytes: int
    gpu_bytes_freed: int
    device: str
    compression: str | None = None
    compressed_expert_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (with ``manifest_version``)."""
        data = asdict(self)
        data["tensors"] = [dict(entry, shape=list(entry["shape"])) for entry in data["tensors"]]
        return {"manifest_version": MANIFEST_VERSION, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def write(self, path: str | Path) -> None:
        """Write the manifest as JSON to ``path``, whole (`expertcache.file_writes`: a failed
        write leaves the file as it was).

        Raises:
            ValueError: a manifest `read` would refuse (nothing is written).
        """
        text = self.to_json()
        _parse(Path(path), json.loads(text))
        write_files({Path(path): (text + "\n").encode("utf-8")})

    @classmethod
    def read(cls, path: str | Path) -> Manifest:
        """Read a manifest written by `write`.

        Raises:
            ValueError: a missing file, not UTF-8 JSON, not a version-2 manifest, or a field
                of the wrong type, out of range or disagreeing with another
                (`expertcache.manifest_checks`; the message names the file and the field).
        """
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: {'is a directory' if path.is_dir() else 'no such file'}")
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text") from None
        except (ValueError, RecursionError) as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
        return _parse(path, data)


def _parse(path: Path, data: object) -> Manifest:
    """The `Manifest` of ``data`` (a JSON document read from ``path``), every field checked."""
    version = data.pop("manifest_version", None) if isinstance(data, dict) else None
    if not isinstance(data, dict) or type(version) is not int or version != MANIFEST_VERSION:  # not 2.0, true
        raise ValueError(f"{path}: not an expertcache manifest (manifest_version {MANIFEST_VERSION})")
    entries = data.pop("tensors", None)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: not an expertcache manifest ('tensors' must be a list, got {entries!r:.40})")
    tensors = tuple(TensorEntry(*check_entry(path, index, entry)) for index, entry in enumerate(entries))
    try:
        manifest = Manifest(tensors=tensors, **data)
    except TypeError as error:
        raise ValueError(f"{path}: not an expertcache manifest ({type(error).__name__}: {error})") from None
    check_manifest(path, manifest)
    return manifest


def build_manifest(providers: Sequence[CachedWeightProvider]) -> Manifest:
    """The manifest of ``providers`` (one layer, or every cached layer of a model).

    Raises:
        ValueError: no provider, a provider listed twice, or providers whose tensors differ.
    """
    if not providers:
        raise ValueError("a manifest needs at least one provider")
    if len({id(provider) for provider in providers}) < len(providers):
        raise ValueError("a provider is listed twice: a manifest counts each cached layer once")
    layout = providers[0].pool.layout
    for provider in providers[1:]:
        layout.check_compatible(provider.pool.layout, what="a provider")
    pools = {id(provider.pool): provider.pool for provider in providers}.values()
    stores = [provider.store for provider in providers]
    distinct = list({id(store): store for store in stores}.values())  # a store layers share is held once
    pool_bytes = sum(t.untyped_storage().nbytes() for pool in pools for t in pool.tensors.values())
    host = [store.buffer.untyped_storage().nbytes() for store in distinct]
    full = sum(store.num_experts for store in stores) * layout.expert_bytes
    compressions = sorted({str(store.compression) for store in stores if store.compression})
    stored = sum(store.num_experts * store.stored_expert_bytes for store in stores)
    return Manifest(
        tensors=tuple(
            TensorEntry(spec.name, spec.shape, str(spec.dtype).removeprefix("torch."), spec.nbytes)
            for spec in layout.specs
        ),
        layers=len(providers),
        experts=sum(store.num_experts for store in stores),
        expert_bytes=layout.expert_bytes,
        num_slots=sum(pool.num_slots for pool in pools),
        pool_gpu_bytes=pool_bytes,
        host_bytes=sum(host),
        pinned_host_bytes=sum(n for n, store in zip(host, distinct, strict=True) if store.pinned),
        full_residency_gpu_bytes=full,
        gpu_bytes_freed=full - pool_bytes,
        device=str(providers[0].device),
        compression=",".join(compressions) or None,
        compressed_expert_bytes=-(-stored // sum(store.num_experts for store in stores)),
    )
