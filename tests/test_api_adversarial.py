"""Odd calls to the Python API a user calls directly: a store shared by layers, device strings
torch reads as another device, a dropped compressed store, file names near the limit, numbers
past a float, experts of no bytes, hand-made layouts. Each gives the right answer or a clear
error naming the argument, and an error changes nothing."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from helpers import random_weights
from test_plan import _trace

from expertcache import CachedWeightProvider, SlotPool
from expertcache.config import ExpertCacheConfig
from expertcache.file_writes import write_files
from expertcache.layout import ExpertLayout, ExpertTensorSpec, layout_from_weights
from expertcache.manifest import Manifest, build_manifest
from expertcache.planner import plan
from expertcache.store import CPUBackingStore


def _weights(dtype=torch.float32):
    return random_weights(4, 8, 4, dtype=dtype, generator=torch.Generator().manual_seed(0))


# -- manifest: what the process holds ------------------------------------------------------------


def test_a_store_shared_by_two_layers_is_counted_once(tmp_path):
    # the manifest said 2x the host bytes: each provider's store was summed, shared or not
    weights = _weights()
    store = CPUBackingStore(layout_from_weights(weights)[1], weights, pin=False)
    layers = [CachedWeightProvider(store, cache_size=2, device="cpu", layer=index) for index in range(2)]
    manifest = build_manifest(layers)
    assert manifest.host_bytes == store.buffer.untyped_storage().nbytes()
    assert manifest.layers == 2 and manifest.experts == 8  # two layers, each of 4 experts
    manifest.write(tmp_path / "m.json")
    assert Manifest.read(tmp_path / "m.json") == manifest


def test_a_provider_listed_twice_is_refused():
    # it counted as two layers (and twice the experts, slots and host bytes)
    provider = CachedWeightProvider(_weights(), cache_size=2, device="cpu")
    with pytest.raises(ValueError, match="a provider is listed twice"):
        build_manifest([provider, provider])


# -- devices: torch keeps an 8-bit index ---------------------------------------------------------


@pytest.mark.parametrize("device", ["cuda:256", "cuda:1000", "cpu:256"])
def test_a_device_index_torch_would_wrap_is_refused(device):
    # torch.device("cuda:256") is cuda:0 and "cuda:1000" is cuda:-24: a config stored that
    # device, and a provider served "cpu:256" from the CPU without a word
    with pytest.raises(ValueError, match=f"device '{device}': no such device index"):
        ExpertCacheConfig(cache_size=2, device=device)
    with pytest.raises(ValueError, match=f"device '{device}': no such device index"):
        CachedWeightProvider(_weights(), cache_size=2, device=device)
    with pytest.raises(ValueError, match=f"device '{device}': no such device index"):
        SlotPool.for_weights(_weights(), 2, device=device)  # every device a pool or an encoder takes
    assert ExpertCacheConfig(cache_size=2, device="cuda:127").device == "cuda:127"
    assert ExpertCacheConfig(cache_size=2, device="cpu:0").device == "cpu"


# -- store: a dropped compressed store lets go of its buffer at once ------------------------------


def test_a_dropped_compressed_store_frees_its_buffer_without_the_garbage_collector():
    # its decoding view held the store, a cycle: the (pinned, GBs) buffer stayed until a
    # collection of the oldest generation, which a long-lived model's stores wait for
    weights = _weights(torch.bfloat16)
    enabled = gc.isenabled()
    gc.disable()
    try:
        store = CPUBackingStore(layout_from_weights(weights)[1], weights, pin=False, compression="exponent")
        assert store.records and torch.equal(store.tensors["w1"], weights["w1"])
        dropped = weakref.ref(store)
        del store
        assert dropped() is None
        provider = CachedWeightProvider(weights, cache_size=2, device="cpu", compression="exponent")
        provider.prepare(torch.tensor([[0, 3]]))
        dropped = weakref.ref(provider.store)
        del provider
        assert dropped() is None
    finally:
        if enabled:
            gc.enable()


# -- files: names near the limit, a write inside a write, links -----------------------------------


def test_a_file_name_near_the_file_system_limit_is_written(tmp_path):
    # the scratch file was ".{name}.{pid}.partial": 20 bytes over a 240-byte name's limit
    path = tmp_path / ("m" * 250)
    path.write_bytes(b"old")
    write_files({path: b"new"})
    assert path.read_bytes() == b"new"
    assert [entry.name for entry in tmp_path.iterdir()] == [path.name]  # no scratch left


class _WritesDuring(Mapping):
    """``{path: data}`` whose iteration writes ``path`` itself, after the first file's scratch
    is written: another thread saving the same file at the same moment."""

    def __init__(self, path, data, other):
        self.path, self.data, self.other = path, data, other

    def __getitem__(self, key):
        return self.data

    def __len__(self):
        return 1

    def __iter__(self):
        yield self.path
        write_files({self.path: self.other})


def test_two_writes_of_one_file_at_once_both_succeed(tmp_path):
    # both used the scratch ".{name}.{pid}.partial": the inner write renamed it away, and the
    # outer one's rename failed (FileNotFoundError), or renamed the other's half-written bytes
    path = tmp_path / "trace.npz"
    write_files(_WritesDuring(path, b"outer", b"inner"))
    assert path.read_bytes() == b"outer"  # the last rename wins, whole
    assert [entry.name for entry in tmp_path.iterdir()] == ["trace.npz"]


def test_a_link_loop_is_refused_and_stays_a_link(tmp_path):
    # realpath stops at a loop: the link was replaced by a regular file
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match="a symbolic link that leads to no file"):
        write_files({loop: b"{}"})
    assert loop.is_symlink()


def test_two_paths_of_one_file_are_refused_before_anything_is_written(tmp_path):
    target, link = tmp_path / "a.csv", tmp_path / "b.csv"
    target.write_bytes(b"old")
    link.symlink_to(target)
    with pytest.raises(ValueError, match="are one file"):
        write_files({target: b"one", link: b"two"})  # which would win?
    assert target.read_bytes() == b"old"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["a.csv", "b.csv"]


# -- plan: numbers past a float, nothing to score -------------------------------------------------


@pytest.fixture(scope="module")
def trace():
    return _trace(tokens=12)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"bandwidth_bytes_per_second": 10**400}, "bandwidth_bytes_per_second must be a positive finite number"),
        ({"min_gain": 10**400}, "min_gain must be a non-negative number"),
        ({"fractions": [10**400]}, r"fractions must be numbers in \(0, 1\]"),
    ],
)
def test_an_int_past_a_float_is_a_bad_value_not_an_overflow(trace, setting, message):
    # math.isfinite(10**400) raised OverflowError: "int too large to convert to float"
    with pytest.raises(ValueError, match=message):
        plan(trace, expert_bytes=1000, gpu_budget_bytes=8000, policies=["lru"], **setting)


def test_a_plan_with_nothing_to_score_is_refused(trace):
    # no fraction, and a budget below the trace's top-k: a plan of no rows, recommending lru
    with pytest.raises(ValueError, match="nothing to score: fractions is empty and the budget buys 0 slots"):
        plan(trace, expert_bytes=1000, gpu_budget_bytes=1000, policies=["lru"], fractions=[])
    result = plan(trace, expert_bytes=1000, gpu_budget_bytes=8000, policies=["lru"], fractions=[])
    assert {row.slots for row in result.rows if row.scope == "layer"} == {4}  # the budget's size


@pytest.mark.parametrize(
    ("progress", "message"),
    [(5, "progress must be a callable progress\\(total\\) -> tick, or None; got int"),
     (lambda total: total, "progress\\(total\\) must return a callable tick, got int")],
)  # fmt: skip
def test_a_progress_that_is_no_callable_is_refused_by_name(trace, progress, message):
    # before: "'int' object is not callable" from deep inside the replays
    with pytest.raises(TypeError, match=message):
        plan(trace, expert_bytes=1000, gpu_budget_bytes=8000, policies=["lru"], progress=progress)
    ticks: list[int] = []
    plan(
        trace,
        expert_bytes=1000,
        gpu_budget_bytes=8000,
        policies=["lru"],
        progress=lambda total: lambda: ticks.append(total),
    )
    assert ticks and len(ticks) == ticks[0]  # one tick per replay, as many as announced


# -- layouts: experts of no bytes, hand-made specs ------------------------------------------------


_PACKED = {"w1": torch.zeros(4, 8, 8, dtype=torch.uint8), "w2": torch.zeros(4, 8, 4, dtype=torch.uint8)}


@pytest.mark.parametrize(
    ("empty", "name"),
    [
        ({"w1": torch.zeros(4, 0, 8), "w2": torch.zeros(4, 8, 0)}, "w1"),  # I = 0
        ({**_PACKED, "w2": torch.zeros(4, 8, 0, dtype=torch.uint8)}, "w2"),  # packed: shapes unchecked
    ],
)
def test_an_expert_matrix_of_no_values_is_refused_and_changes_nothing(empty, name):
    # a cache of 0-byte matrices was built and served; with both empty its manifest then
    # failed to write ("expert_bytes must be a positive integer") and plan refused its size
    weights = _weights()
    pool = SlotPool.for_weights(weights, 2, device="cpu")
    CachedWeightProvider(weights, pool=pool, layer="first")
    message = rf"weights\['{name}'\] holds no value per expert"
    with pytest.raises(ValueError, match=message):
        layout_from_weights(empty)
    with pytest.raises(ValueError, match=message):
        CachedWeightProvider(empty, pool=pool, layer="second")
    assert list(pool.layers) == ["first"]
    assert layout_from_weights({**weights, "bias": torch.zeros(4, 0)})[1].expert_bytes > 0  # an empty extra is fine


def test_a_layout_of_specs_in_a_list_serves_like_one_in_a_tuple():
    # ExpertLayout([...]) and shape [8, 8] built a pool that refused the very weights it
    # describes ("registers (...), but the slot pool holds [...]")
    weights = _weights()
    specs = [ExpertTensorSpec(name, list(tensor.shape[1:]), tensor.dtype) for name, tensor in weights.items()]
    layout = ExpertLayout(specs)
    assert layout == layout_from_weights(weights)[1]
    assert ExpertTensorSpec("w1", (np.int64(8), 8), torch.float32).shape == (8, 8)
    provider = CachedWeightProvider(weights, pool=SlotPool(layout, 2, device="cpu"))
    result = provider.prepare(torch.tensor([[1, 3]]))
    assert torch.equal(result.w1[result.topk_ids[0, 1]], weights["w1"][3])


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: ExpertTensorSpec("w1", (-8, 8), torch.float32), ValueError, "shape entry must be >= 0"),
        (lambda: ExpertTensorSpec("w1", (8, 8), "float32"), TypeError, "dtype must be a torch.dtype"),
        (lambda: ExpertTensorSpec("w1", (8, True), torch.float32), TypeError, "shape entry must be an int"),
        (lambda: ExpertTensorSpec(1, (8,), torch.float32), TypeError, "name must be a str"),
        (lambda: ExpertLayout(()), ValueError, "at least one tensor"),
        (lambda: ExpertLayout((ExpertTensorSpec("w1", (8,), torch.float32),) * 2), ValueError, "distinct names"),
        (lambda: ExpertLayout(("w1", "w2")), TypeError, "sequence of ExpertTensorSpec"),
    ],
)
def test_a_bad_hand_made_layout_is_refused_when_built(make, error, message):
    # a negative shape failed in torch.full when a pool was built; the others built pools
    # that could never serve
    with pytest.raises(error, match=message):
        make()


def test_a_rewritten_file_keeps_its_permissions(tmp_path):
    # the scratch was created with the umask's mode and renamed over the target: a manifest
    # or trace made private (0600) came back readable by everyone
    path = tmp_path / "private.json"
    path.write_bytes(b"old")
    path.chmod(0o600)
    write_files({path: b"new"})
    assert path.read_bytes() == b"new"
    assert path.stat().st_mode & 0o777 == 0o600
