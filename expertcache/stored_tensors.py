"""A store's registered tensors looked up by name: `spec_named`, and `StoredTensors`, the
``{name: [E, *shape]}`` mapping of a compressed `CPUBackingStore` (raw names as views into
its buffer, coded names decoded on each access)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from expertcache.exponent_code import RecordFormat
from expertcache.exponent_decode import decode_records_torch as decode_records
from expertcache.layout import ExpertLayout, ExpertTensorSpec


def spec_named(layout: ExpertLayout, name: object) -> ExpertTensorSpec:
    """The registered tensor ``name`` of ``layout``.

    Raises:
        KeyError: ``name`` is not registered (the message lists the names that are).
    """
    for spec in layout.specs:
        if spec.name == name:
            return spec
    raise KeyError(f"{name!r} is not a registered tensor; the store holds {[s.name for s in layout.specs]}")


class StoredTensors(Mapping):
    """``{name: [E, *shape]}`` of a compressed store: raw views, coded names decoded on access.

    It holds the store's parts, not the store: a reference back would make a cycle that
    keeps the (pinned) buffer until the garbage collector happens to run."""

    def __init__(
        self,
        layout: ExpertLayout,
        raw: dict[str, torch.Tensor],
        records: dict[str, torch.Tensor],
        formats: dict[str, RecordFormat],
    ) -> None:
        self._layout, self._raw, self._records, self._formats = layout, raw, records, formats

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._raw:
            return self._raw[name]
        spec = spec_named(self._layout, name)  # KeyError if absent: `in` and `get` rely on it
        records = self._records[name]
        return decode_records(records, self._formats[name]).view(records.shape[0], *spec.shape)

    def __iter__(self) -> Iterator[str]:
        return (spec.name for spec in self._layout.specs)

    def __len__(self) -> int:
        return len(self._layout.specs)
