"""Fixes of a review of the manifest, the backing store's pin budget and multi-file writes.

* `Manifest.read` took hand edits that made a manifest disagree with itself: a tensor's
  ``bytes`` that are not its shape times its dtype's size, a dtype torch does not have, two
  tensors of one name, slot and residency totals that do not add up.
* A compressed `CPUBackingStore` ran its whole analysis pass before refusing a pin budget
  that even its smallest possible records exceed.
* `write_files` renamed its files one by one: when a later rename failed, the earlier files
  were already replaced.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import random_weights
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import expertcache.file_writes as file_writes
import expertcache.store as store_module
from expertcache import CachedWeightProvider
from expertcache.errors import PinBudgetError
from expertcache.file_writes import write_files
from expertcache.layout import layout_from_weights
from expertcache.manifest import Manifest
from expertcache.store import CPUBackingStore

# -- Manifest.read: a manifest that disagrees with itself -------------------------------------


def _written(path: Path) -> dict:
    """Write a real manifest (6 float32 experts of 5 tensors, 3 slots) to ``path``; its JSON."""
    weights = random_weights(6, 16, 8, extras=True, generator=torch.Generator().manual_seed(0))
    CachedWeightProvider(weights, cache_size=3, device="cpu").manifest().write(path)
    return json.loads(path.read_text())


def _entry(data: dict, name: str) -> dict:
    return next(entry for entry in data["tensors"] if entry["name"] == name)


def _bytes_off_by_4(data: dict) -> None:  # sums still agree: only the entry is wrong
    _entry(data, "w2")["bytes"] += 4
    data["expert_bytes"] += 4
    data.update(pool_gpu_bytes=data["num_slots"] * data["expert_bytes"])
    data.update(full_residency_gpu_bytes=data["experts"] * data["expert_bytes"], compressed_expert_bytes=None)
    data.update(gpu_bytes_freed=data["full_residency_gpu_bytes"] - data["pool_gpu_bytes"])


def _residency(data: dict, field: str) -> None:  # 'gpu_bytes_freed' kept the difference
    data[field] += 1616
    data["gpu_bytes_freed"] = data["full_residency_gpu_bytes"] - data["pool_gpu_bytes"]


W2 = "'tensors' entry 1"  # w2 (w1, w2, then the rest by name)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_bytes_off_by_4, rf"{W2}: 'bytes' \(516\) must be its shape \[16, 8\] times float32's 4 bytes \(512\)"),
        (lambda d: _entry(d, "w2").update(shape=[16, 9]), r"{W2}: 'bytes' \(512\) must be .* \[16, 9\] .* \(576\)"),
        (lambda d: _entry(d, "w2").update(dtype="float16"), r"{W2}: 'bytes' \(512\) .* float16's 2 bytes \(256\)"),
        (lambda d: _entry(d, "w2").update(dtype="float33"), rf"{W2}: 'dtype' must name a torch dtype .* 'float33'"),
        (lambda d: _entry(d, "w2").update(dtype="Tensor"), rf"{W2}: 'dtype' must name a torch dtype .* 'Tensor'"),
        (lambda d: _entry(d, "w2").update(dtype=""), rf"{W2}: 'dtype' must name a torch dtype"),
        (lambda d: _entry(d, "w2").update(name="w1"), rf"{W2}: 'name' 'w1' is listed twice"),
        (lambda d: _residency(d, "full_residency_gpu_bytes"),
         r"'full_residency_gpu_bytes' \(11312\) must be 'experts' x 'expert_bytes' \(6 x 1616 = 9696\)"),
        (lambda d: _residency(d, "pool_gpu_bytes"),
         r"'pool_gpu_bytes' \(6464\) must be 'num_slots' x 'expert_bytes' \(3 x 1616 = 4848\)"),
        (lambda d: d.update(num_slots=4), r"'pool_gpu_bytes' \(4848\) must be 'num_slots' x 'expert_bytes'"),
        (lambda d: d.update(experts=7), r"'full_residency_gpu_bytes' \(9696\) must be 'experts' x 'expert_bytes'"),
        (lambda d: d.update(layers=7), r"'layers' \(7\) must be at most 'experts' \(6\): each layer has at least one"),
        (lambda d: (d.update(compression="exponent"), d.pop("compressed_expert_bytes")),
         r"'compressed_expert_bytes' is missing; a manifest with a 'compression' \('exponent'\) needs it"),
        (lambda d: d.update(compression="exponent,exponent"), r"'compression' names 'exponent' twice"),
        (lambda d: d.update(device="gpu"), r"'device' must name a torch device \(cpu, cuda:0, \.\.\.\), got 'gpu'"),
    ],
    ids=["bytes", "shape", "dtype-size", "unknown-dtype", "not-a-dtype", "empty-dtype", "twice", "full", "pool",
         "slots", "experts", "layers", "coded-size-missing", "compression-twice", "device"],
)  # fmt: skip
def test_a_manifest_that_disagrees_with_itself_is_refused_naming_file_and_field(tmp_path, change, message):
    path = tmp_path / "manifest.json"
    data = _written(path)
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"^{path}: {message.replace('{W2}', W2)}"):
        Manifest.read(path)


def test_consistent_manifests_are_still_taken(tmp_path):
    """Controls: the written manifest, ``torch.``-prefixed and aliased dtype names (what
    ``str(dtype)`` writes, and torch's own aliases), an old manifest without the coded
    fields, a hand-written one that lists no tensors."""
    path = tmp_path / "manifest.json"
    data = _written(path)
    written = Manifest.read(path)
    _entry(data, "w1").update(dtype="torch.float32")
    _entry(data, "w2").update(dtype="float")  # torch.float is torch.float32
    path.write_text(json.dumps({key: value for key, value in data.items() if "compress" not in key}))
    assert dataclasses.replace(Manifest.read(path), tensors=written.tensors) == dataclasses.replace(
        written, compressed_expert_bytes=None
    )
    path.write_text(json.dumps({**data, "tensors": [], "device": "cuda:1"}))
    assert Manifest.read(path).device == "cuda:1"


def test_writing_a_manifest_whose_totals_disagree_leaves_the_file(tmp_path):
    path = tmp_path / "manifest.json"
    _written(path)
    before = path.read_bytes()
    manifest = Manifest.read(path)
    with pytest.raises(ValueError, match="'full_residency_gpu_bytes' .* must be 'experts' x 'expert_bytes'"):
        dataclasses.replace(manifest, experts=7).write(path)
    assert path.read_bytes() == before


_TOTALS = ("experts", "expert_bytes", "num_slots", "pool_gpu_bytes", "full_residency_gpu_bytes", "gpu_bytes_freed",
           "compressed_expert_bytes")  # fmt: skip


@st.composite
def _edits(draw) -> tuple[tuple, int]:
    """Where one integer of the manifest is changed (a total, a tensor's bytes or a shape
    entry) and by how much (never 0)."""
    kind = draw(st.sampled_from(["total", "bytes", "shape"]))
    entry = draw(st.integers(0, 4))
    if kind == "total":
        where: tuple = (draw(st.sampled_from(_TOTALS)),)
    elif kind == "bytes":
        where = ("tensors", entry, "bytes")
    else:
        where = ("tensors", entry, "shape", draw(st.integers(0, 1)))
    return where, draw(st.integers(-5000, 5000).filter(bool))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=_edits())
def test_changing_any_one_integer_the_others_determine_is_refused(tmp_path, edit):
    """Each of these integers is determined by the others: one changed alone is refused."""
    path = tmp_path / "manifest.json"
    data = _written(path)
    (*parents, last), delta = edit
    holder = data
    for key in parents:
        holder = holder[key]
    if isinstance(holder, list) and last >= len(holder):  # w1_scale's shape is []: no entry to change
        return
    holder[last] += delta
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"^{path}: "):
        Manifest.read(path)


# -- CPUBackingStore: the pin budget before the analysis --------------------------------------


def _bf16_weights() -> dict[str, torch.Tensor]:
    return random_weights(4, 64, 32, dtype=torch.bfloat16, extras=True, generator=torch.Generator().manual_seed(1))


def _no_analysis(*args, **kwargs):
    raise AssertionError("the analysis pass ran before the pin budget was checked")


def _store(weights, **kwargs) -> CPUBackingStore:
    return CPUBackingStore(layout_from_weights(weights)[1], weights, pin=False, compression="exponent", **kwargs)


def test_a_budget_below_the_smallest_coded_store_is_refused_before_the_analysis(monkeypatch):
    weights = _bf16_weights()
    coded = _store(weights).nbytes
    raw = layout_from_weights(weights)[1].buffer_bytes(4)
    assert coded < raw  # the code pays on these experts
    monkeypatch.setattr(store_module, "analyse", _no_analysis)
    # a literal byte per bf16 value, before any code: below half the raw bytes nothing fits
    for budget in (0, 1, raw // 2):
        with pytest.raises(PinBudgetError, match=f"pin_budget_bytes is {budget} ") as error:
            _store(weights, pin_budget_bytes=budget)
        assert budget < error.value.needed <= coded  # what it says is needed is needed


def test_a_budget_the_analysis_decides_is_still_checked_exactly(monkeypatch):
    weights = _bf16_weights()
    coded = _store(weights).nbytes
    with pytest.raises(PinBudgetError, match=f"needs {coded} bytes .* pin_budget_bytes is {coded - 1} "):
        _store(weights, pin_budget_bytes=coded - 1)
    assert _store(weights, pin_budget_bytes=coded).nbytes == coded  # the exact size fits


# -- write_files: all files or none ------------------------------------------------------------


def _failing_rename_to(failing: Path, monkeypatch) -> list[tuple[str, str]]:
    """Make renaming a scratch file over ``failing`` fail; the renames that were asked for."""
    real, calls = os.replace, []

    def replace(source, target):
        calls.append((os.fspath(source), os.fspath(target)))
        if os.fspath(target) == os.fspath(failing) and os.fspath(source).endswith(".partial"):
            raise PermissionError(13, "Permission denied", os.fspath(source), None, os.fspath(target))
        real(source, target)

    monkeypatch.setattr(file_writes.os, "replace", replace)
    return calls


@pytest.mark.parametrize("first_exists", [True, False], ids=["first-replaced", "first-new"])
def test_a_failed_later_rename_leaves_every_file_as_it_was(tmp_path, monkeypatch, first_exists):
    first, second, third = tmp_path / "a.csv", tmp_path / "b.png", tmp_path / "c.json"
    if first_exists:
        first.write_bytes(b"old a")
        os.chmod(first, 0o600)
    second.write_bytes(b"old b")
    calls = _failing_rename_to(second, monkeypatch)
    with pytest.raises(PermissionError) as error:
        write_files({first: b"new a", second: b"new b", third: b"new c"})
    assert error.value.filename == str(second)  # the target, not the scratch
    assert any(target == str(first) for _, target in calls)  # the first file had been renamed
    assert second.read_bytes() == b"old b" and not third.exists()
    if first_exists:
        assert first.read_bytes() == b"old a" and (first.stat().st_mode & 0o777) == 0o600
    else:
        assert not first.exists()
    expected = ["a.csv", "b.png"] if first_exists else ["b.png"]
    assert sorted(path.name for path in tmp_path.iterdir()) == expected  # no scratch, no copy of an old file


def test_files_are_written_whole_where_hard_links_are_refused(tmp_path, monkeypatch):
    """A file system without hard links: the old files are kept aside as copies."""

    def no_link(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(file_writes.os, "link", no_link)
    first, second = tmp_path / "a.csv", tmp_path / "b.png"
    first.write_bytes(b"old a")
    second.write_bytes(b"old b")
    _failing_rename_to(second, monkeypatch)
    with pytest.raises(PermissionError):
        write_files({first: b"new a", second: b"new b"})
    assert first.read_bytes() == b"old a" and second.read_bytes() == b"old b"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.csv", "b.png"]
    monkeypatch.undo()
    monkeypatch.setattr(file_writes.os, "link", no_link)
    write_files({first: b"new a", second: b"new b"})  # control: no failure, both written
    assert first.read_bytes() == b"new a" and second.read_bytes() == b"new b"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.csv", "b.png"]


def test_an_old_file_that_cannot_be_put_back_is_kept_and_named(tmp_path, monkeypatch):
    """The rename back fails too: the old file stays under its kept name, which the error says."""
    first, second = tmp_path / "a.csv", tmp_path / "b.png"
    first.write_bytes(b"old a")
    second.write_bytes(b"old b")
    real = os.replace

    def replace(source, target):
        source = os.fspath(source)
        if (source.endswith(".partial") and os.fspath(target) == str(second)) or source.endswith(".old"):
            raise PermissionError(13, "Permission denied")
        real(source, target)

    monkeypatch.setattr(file_writes.os, "replace", replace)
    with pytest.raises(PermissionError) as error:
        write_files({first: b"new a", second: b"new b"})
    kept = [path for path in tmp_path.iterdir() if path.name.endswith(".old")]
    assert len(kept) == 1 and kept[0].read_bytes() == b"old a"
    assert error.value.filename == str(second)
    assert error.value.strerror == f"Permission denied; {first} could not be put back, its old file is {kept[0]}"
    assert second.read_bytes() == b"old b"


def test_a_buffer_released_during_another_flush_waits_for_its_own_synchronize(monkeypatch):
    """Thread B releases buffer X while thread A's flush synchronizes: A must not unregister
    X after a synchronize that ran before X's last use was queued (the old loop popped every
    buffer deferred by then)."""
    import expertcache.pinned_host as pinned_host

    first, late = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    syncs, unregistered = [], []

    def synchronize(device):
        syncs.append(device)
        if len(syncs) == 1:  # another thread's release lands while this one waits
            pinned_host._DEFERRED.append(late)

    class Runtime:
        @staticmethod
        def cudaHostUnregister(pointer):
            unregistered.append((pointer, len(syncs)))

    monkeypatch.setattr(pinned_host, "_DEFERRED", [])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime)
    pinned_host.release(first)
    assert unregistered == [(first.data_ptr(), 1)]
    pinned_host.flush_released()  # the late buffer's own flush
    assert unregistered == [(first.data_ptr(), 1), (late.data_ptr(), 2)]
    assert pinned_host._DEFERRED == []
