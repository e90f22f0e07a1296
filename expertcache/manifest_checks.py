"""What `expertcache.manifest.Manifest.read` checks of a manifest file, field by field.

`Manifest.write` writes what `build_manifest` measured, so a manifest that disagrees with
itself was edited by hand or damaged; each check below refuses one such file with a
ValueError naming the file and the field.

Types and ranges:

* ``experts``, ``layers``, ``expert_bytes`` and ``compressed_expert_bytes`` are JSON integers
  of at least 1 (not ``12.0``, ``true`` or ``"12"``); ``experts`` and ``layers`` at most
  `expertcache.manifest.MAX_COUNT`, ``expert_bytes`` at most
  `expertcache.manifest.MAX_EXPERT_BYTES`.
* the slot and byte totals are integers >= 0 (``gpu_bytes_freed`` any integer); ``device``
  names a torch device; ``compression`` is null or names of
  `expertcache.compression.COMPRESSIONS`, comma-separated and each once (the layers' stores
  differ).
* each ``tensors`` entry has exactly a string ``name``, a ``dtype`` naming a torch dtype
  (``float32``; ``torch.float32`` and torch's aliases such as ``float`` too), a ``shape`` of
  integers >= 0 and an integer ``bytes`` >= 0; no name is listed twice.

What the fields determine of each other (`build_manifest` makes them so):

* a tensor's ``bytes`` is its shape's product times its dtype's size, and ``expert_bytes``
  the sum of the tensors' bytes (a hand-written manifest may list no tensors);
* ``full_residency_gpu_bytes`` is ``experts x expert_bytes``, ``pool_gpu_bytes`` is
  ``num_slots x expert_bytes`` (every slot holds one expert) and ``gpu_bytes_freed`` their
  difference; ``layers`` is at most ``experts`` (a layer has at least one expert);
* ``pinned_host_bytes`` is at most ``host_bytes``;
* ``compressed_expert_bytes`` is at most ``expert_bytes`` (a coded tensor is stored only
  where it is smaller), equal to it when ``compression`` is null, and present when
  ``compression`` is not (both are absent from older, raw manifests).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from expertcache.compression import COMPRESSIONS

if TYPE_CHECKING:
    from expertcache.manifest import Manifest

_ENTRY_KEYS = ("bytes", "dtype", "name", "shape")

_TOTALS = ("num_slots", "pool_gpu_bytes", "host_bytes", "pinned_host_bytes", "full_residency_gpu_bytes")


def check_entry(path: Path, index: int, entry: object) -> tuple[str, tuple[int, ...], str, int]:
    """``(name, shape, dtype, bytes)`` of one ``tensors`` entry (``entry``, the ``index``-th
    of the file ``path``), its fields checked and none converted (``5`` is not a name).

    Raises:
        ValueError: a key missing or extra, or a field of the wrong type or range (the
            message names the file, the entry and the field).
    """
    where = f"{path}: 'tensors' entry {index}"
    if not isinstance(entry, dict) or sorted(entry) != list(_ENTRY_KEYS):
        raise ValueError(f"{where} must have the keys {', '.join(_ENTRY_KEYS)}, got {entry!r:.60}")
    for key in ("name", "dtype"):
        if not isinstance(entry[key], str):
            raise ValueError(f"{where}: {key!r} must be a string, got {entry[key]!r:.40}")
    if _torch_dtype(entry["dtype"]) is None:
        raise ValueError(
            f"{where}: 'dtype' must name a torch dtype (float32, bfloat16, ...), got {entry['dtype']!r:.40}"
        )
    shape, nbytes = entry["shape"], entry["bytes"]
    if not isinstance(shape, list) or any(type(size) is not int or size < 0 for size in shape):
        raise ValueError(f"{where}: 'shape' must be a list of integers >= 0, got {shape!r:.40}")
    if type(nbytes) is not int or nbytes < 0:
        raise ValueError(f"{where}: 'bytes' must be an integer >= 0, got {nbytes!r:.40}")
    return entry["name"], tuple(shape), entry["dtype"], nbytes


def _torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype ``name`` spells (``float32``, ``torch.float32``, ``float``), else None."""
    found = getattr(torch, name.removeprefix("torch."), None) if name.removeprefix("torch.") else None
    return found if isinstance(found, torch.dtype) else None


def check_manifest(path: Path, manifest: Manifest) -> None:
    """Check ``manifest`` (read from ``path``) for everything of the module docstring past
    one entry's own fields.

    Raises:
        ValueError: the first check that fails, naming the file and the field.
    """
    _check_sizes(path, manifest)
    _check_totals(path, manifest)
    _check_tensors(path, manifest)
    _check_residency(path, manifest)


def _check_sizes(path: Path, manifest: Manifest) -> None:
    """The fields a plan uses."""
    from expertcache.manifest import MAX_COUNT, MAX_EXPERT_BYTES  # their public home, which imports this module

    for name in ("experts", "layers"):
        _check_count(path, name, getattr(manifest, name), MAX_COUNT, "MAX_COUNT")
    if manifest.layers > manifest.experts:
        raise ValueError(
            f"{path}: 'layers' ({manifest.layers}) must be at most 'experts' ({manifest.experts}): "
            "each layer has at least one expert"
        )
    _check_count(path, "expert_bytes", manifest.expert_bytes, MAX_EXPERT_BYTES, "MAX_EXPERT_BYTES")
    _check_compression(path, manifest.compression)
    coded = manifest.compressed_expert_bytes
    if coded is None:
        if manifest.compression is not None:
            raise ValueError(
                f"{path}: 'compressed_expert_bytes' is missing; a manifest with a 'compression' "
                f"({manifest.compression!r:.40}) needs it"
            )
        return
    _check_count(path, "compressed_expert_bytes", coded, manifest.expert_bytes, "the 'expert_bytes'")
    if manifest.compression is None and coded != manifest.expert_bytes:
        raise ValueError(
            f"{path}: 'compressed_expert_bytes' ({coded}) must equal 'expert_bytes' ({manifest.expert_bytes}) "
            "when 'compression' is null (a raw store)"
        )


def _check_compression(path: Path, compression: object) -> None:
    if compression is None:
        return
    names = compression.split(",") if isinstance(compression, str) else []
    if not names or any(name not in COMPRESSIONS for name in names):
        choices = ", ".join(COMPRESSIONS)
        raise ValueError(f"{path}: 'compression' must be null or one of {choices}, got {compression!r:.40}")
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise ValueError(f"{path}: 'compression' names {twice!r} twice, got {compression!r:.40}")


def _check_count(path: Path, name: str, value: object, maximum: int, what: str) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{path}: {name!r} must be a positive integer, got {value!r:.40}")
    if value > maximum:
        raise ValueError(f"{path}: {name!r} must be at most {what} ({maximum:,}), got {value:,}")


def _check_totals(path: Path, manifest: Manifest) -> None:
    """The fields a plan does not use: their types, and ``pinned_host_bytes <= host_bytes``."""
    for name in _TOTALS:
        value = getattr(manifest, name)
        if type(value) is not int or value < 0:
            raise ValueError(f"{path}: {name!r} must be an integer >= 0, got {value!r:.40}")
    if type(manifest.gpu_bytes_freed) is not int:
        raise ValueError(f"{path}: 'gpu_bytes_freed' must be an integer, got {manifest.gpu_bytes_freed!r:.40}")
    if not isinstance(manifest.device, str):
        raise ValueError(f"{path}: 'device' must be a string, got {manifest.device!r:.40}")
    try:
        torch.device(manifest.device)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{path}: 'device' must name a torch device (cpu, cuda:0, ...), got {manifest.device!r:.40}"
        ) from None
    pinned, host = manifest.pinned_host_bytes, manifest.host_bytes
    if pinned > host:
        raise ValueError(f"{path}: 'pinned_host_bytes' ({pinned}) must be at most 'host_bytes' ({host})")


def _check_tensors(path: Path, manifest: Manifest) -> None:
    """The tensors' names once each, their bytes summing to ``expert_bytes``, each tensor's
    bytes its shape times its dtype's size."""
    names: set[str] = set()
    for index, entry in enumerate(manifest.tensors):
        if entry.name in names:
            raise ValueError(f"{path}: 'tensors' entry {index}: 'name' {entry.name!r:.40} is listed twice")
        names.add(entry.name)
    listed = sum(entry.bytes for entry in manifest.tensors)
    if manifest.tensors and listed != manifest.expert_bytes:  # a hand-written manifest may list none
        raise ValueError(
            f"{path}: 'expert_bytes' ({manifest.expert_bytes}) must be the sum of the tensors' bytes ({listed})"
        )
    for index, entry in enumerate(manifest.tensors):
        dtype = _torch_dtype(entry.dtype)
        assert dtype is not None  # check_entry refused the others
        size = math.prod(entry.shape) * dtype.itemsize
        if entry.bytes != size:
            spelled = str(dtype).removeprefix("torch.")
            raise ValueError(
                f"{path}: 'tensors' entry {index}: 'bytes' ({entry.bytes}) must be its shape {list(entry.shape)} "
                f"times {spelled}'s {dtype.itemsize} bytes ({size})"
            )


def _check_residency(path: Path, manifest: Manifest) -> None:
    """The GPU totals: each a count of experts times ``expert_bytes``, and their difference."""
    expert_bytes = manifest.expert_bytes
    for total, count in (("full_residency_gpu_bytes", "experts"), ("pool_gpu_bytes", "num_slots")):
        value, number = getattr(manifest, total), getattr(manifest, count)
        if value != number * expert_bytes:
            raise ValueError(
                f"{path}: {total!r} ({value}) must be {count!r} x 'expert_bytes' "
                f"({number} x {expert_bytes} = {number * expert_bytes})"
            )
    full, pool = manifest.full_residency_gpu_bytes, manifest.pool_gpu_bytes
    if manifest.gpu_bytes_freed != full - pool:
        raise ValueError(
            f"{path}: 'gpu_bytes_freed' ({manifest.gpu_bytes_freed}) must be 'full_residency_gpu_bytes' - "
            f"'pool_gpu_bytes' ({full - pool})"
        )
