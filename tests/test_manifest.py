"""The manifest reports the real allocations: slot tensors, host buffers, pinned bytes."""

from __future__ import annotations

import pytest
import torch
from helpers import random_weights

from expertcache import CachedWeightProvider, SlotPool
from expertcache.manifest import Manifest, build_manifest


def _weights():
    return random_weights(6, 16, 8, extras=True, generator=torch.Generator().manual_seed(0))


def test_layer_manifest_equals_the_allocations(tmp_path):
    weights = _weights()
    provider = CachedWeightProvider(weights, cache_size=3, device="cpu")
    manifest = provider.manifest()
    entries = {entry.name: entry for entry in manifest.tensors}
    assert set(entries) == set(weights)
    for name, tensor in weights.items():
        assert entries[name].shape == tuple(tensor.shape[1:])
        assert entries[name].dtype == str(tensor.dtype).removeprefix("torch.")
        assert entries[name].bytes * tensor.shape[0] == tensor.nbytes
    assert manifest.expert_bytes == sum(entry.bytes for entry in manifest.tensors)
    assert manifest.num_slots == 3
    assert manifest.pool_gpu_bytes == sum(t.untyped_storage().nbytes() for t in provider.pool.tensors.values())
    assert manifest.pool_gpu_bytes == 3 * manifest.expert_bytes == provider.pool.nbytes
    assert manifest.host_bytes == provider.store.buffer.untyped_storage().nbytes()
    assert manifest.host_bytes == provider.pool.layout.buffer_bytes(6)
    # the alignment padding between regions is all that is added
    assert 0 <= manifest.host_bytes - 6 * manifest.expert_bytes < 256 * len(manifest.tensors)
    assert manifest.pinned_host_bytes == 0  # a CPU-only store is plain memory
    assert manifest.full_residency_gpu_bytes == sum(t.nbytes for t in weights.values())
    assert manifest.gpu_bytes_freed == manifest.full_residency_gpu_bytes - manifest.pool_gpu_bytes
    path = tmp_path / "manifest.json"
    manifest.write(path)
    assert Manifest.read(path) == manifest


def test_model_manifest_counts_a_shared_pool_once():
    weights = _weights()
    pool = SlotPool.for_weights(weights, 5, device="cpu")
    layers = [CachedWeightProvider(weights, pool=pool, layer=index) for index in range(3)]
    manifest = build_manifest(layers)
    assert manifest.layers == 3 and manifest.experts == 18
    assert manifest.num_slots == 5
    assert manifest.pool_gpu_bytes == pool.nbytes == 5 * manifest.expert_bytes
    assert manifest.host_bytes == sum(p.store.buffer.untyped_storage().nbytes() for p in layers)
    assert manifest.full_residency_gpu_bytes == 3 * sum(t.nbytes for t in weights.values())


def test_manifest_of_nothing_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        build_manifest([])


@pytest.mark.gpu
def test_gpu_manifest_counts_pinned_bytes_and_the_device_allocation():
    weights = _weights()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    pool = SlotPool.for_weights(weights, 4, device="cuda")
    allocated = torch.cuda.memory_allocated() - before
    provider = CachedWeightProvider(weights, pool=pool)
    manifest = provider.manifest()
    assert manifest.pool_gpu_bytes == pool.nbytes
    # the caching allocator hands out 512-byte blocks; the pool asks for exactly its bytes
    # (one allocation per slot tensor, and the state buffer of its tables)
    blocks = [t.nbytes for t in pool.tensors.values()] + [pool.tables.buffer.nbytes]
    assert allocated == sum(-(-n // 512) * 512 for n in blocks)
    assert provider.store.buffer.is_pinned()
    assert manifest.pinned_host_bytes == manifest.host_bytes == pool.layout.buffer_bytes(6)
