"""What one miss of ``expertcache plan`` costs, and over how many layers: from its flags.

The expert sizes come from ``--expert-bytes`` or a ``--manifest`` (`read_manifest_sizes`),
the model's MoE layers from ``--layers``, a manifest of several layers or the trace
(`model_layers`), and the bytes a miss moves host -> GPU from ``--compression``
(`bytes_per_miss`: raw, or an exponent-coded store's measured or assumed bytes).
"""

from __future__ import annotations

import math
from pathlib import Path

#: Coded / raw bytes of an exponent-coded bf16 expert when nothing better is known: the top
#: of what ``benchmarks/compression_ratio.py`` and ``bench_compression.py`` measure on
#: normal-initialised bf16 weights and the random families' experts with the default code
#: (0.68-0.69). Trained weights, and fp16 (~0.87: its exponent is 5 bits), differ: measure
#: with a manifest.
DEFAULT_EXPONENT_RATIO = 0.69


def read_manifest_sizes(path: str | Path) -> tuple[int, int]:
    """``(expert_bytes, experts per layer)`` from a manifest written by ``Manifest.write``.

    Raises:
        ValueError: anything `Manifest.read` refuses, or experts that do not split evenly
            over the layers (the message names the file).
    """
    from expertcache.manifest import Manifest

    try:
        manifest = Manifest.read(path)
    except ValueError as error:
        raise ValueError(f"--manifest {error}") from None
    if manifest.experts % manifest.layers:
        raise ValueError(
            f"--manifest {path}: {manifest.experts} experts do not split evenly over {manifest.layers} layers"
        )
    return manifest.expert_bytes, manifest.experts // manifest.layers


def model_layers(traced: int, layers: int | None, manifest: str | Path | None) -> tuple[int, str]:
    """``(MoE layers of the model, a line saying they come from the manifest or "")``.

    The budget is split over these layers and per-token costs are scaled to them
    (`expertcache.planner.plan`'s ``model_layers``): ``--layers`` when given; else the layers
    of a manifest covering several (`expertcache.manifest.build_manifest` of every cached
    layer: the model's); else the trace's. A manifest of one layer (``provider.manifest()``)
    gives the expert sizes only.

    Args:
        traced: the layers the trace records.
        layers: ``--layers`` (None: not given).
        manifest: ``--manifest`` (None: not given), already checked by `read_manifest_sizes`.

    Raises:
        ValueError: ``--layers``, or a manifest of several layers, below ``traced``; or
            ``--layers`` and such a manifest disagreeing.
    """
    from expertcache.manifest import Manifest

    if layers is not None and layers < traced:
        raise ValueError(f"--layers {layers} is fewer than the {traced} MoE layers the trace records")
    covered = Manifest.read(manifest).layers if manifest is not None else 1
    if covered == 1:  # no manifest, or one layer's: it says nothing of the model's layers
        return layers or traced, ""
    if covered < traced:
        raise ValueError(
            f"--manifest {manifest} covers {covered} MoE layers, fewer than the {traced} the trace records: the "
            "plan would be for another model (a manifest of one layer, provider.manifest(), gives expert sizes only)"
        )
    if layers is not None and layers != covered:
        raise ValueError(f"--layers {layers} disagrees with --manifest {manifest}, which covers {covered} MoE layers")
    if covered == traced:
        return covered, ""
    return covered, (
        f"model layers {covered} (from --manifest {manifest}; the trace records {traced}): the GPU budget is split "
        f"over all {covered}, per-token costs scaled up from the traced layers"
    )


def read_manifest_copy_bytes(path: str | Path) -> int | None:
    """The bytes one miss reads from an exponent-coded store the manifest describes (its
    ``compressed_expert_bytes``); None when the manifest's store is raw."""
    from expertcache.manifest import Manifest

    manifest = Manifest.read(path)  # read_manifest_sizes has already checked it
    if manifest.compression != "exponent" or manifest.compressed_expert_bytes is None:
        return None
    return manifest.compressed_expert_bytes


def bytes_per_miss(compression: str, ratio: float | None, expert_bytes: int, measured: int | None) -> tuple[int, str]:
    """``(bytes one miss moves host -> GPU, where the figure comes from)``; ``""`` when raw.

    Args:
        compression: ``"none"`` or ``"exponent"``.
        ratio: ``--compression-ratio`` (None: not given).
        expert_bytes: raw bytes of one expert (what a slot holds).
        measured: an exponent-coded manifest's ``compressed_expert_bytes`` (None: none).
    """
    if compression != "exponent":
        return expert_bytes, ""
    if ratio is not None:
        return math.ceil(expert_bytes * ratio), f"exponent-coded, --compression-ratio {ratio:g}"
    if measured is not None:
        return measured, "exponent-coded, measured on the model's experts (manifest)"
    return (
        math.ceil(expert_bytes * DEFAULT_EXPONENT_RATIO),
        f"exponent-coded, default ratio {DEFAULT_EXPONENT_RATIO} of normal bf16 weights; a manifest measures yours",
    )
