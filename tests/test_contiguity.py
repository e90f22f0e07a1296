"""Every tensor of every result is contiguous, and a kernel that finds entry ``s`` at
``data_ptr + s * entry_bytes`` reads the right expert, in every mode and pool kind."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import devices
from helpers import random_topk, random_weights

from expertcache import CachedWeightProvider, FullGPUProvider, SlotPool


@triton.jit
def _read_bytes(base_ptr, out_ptr, offset, count, BLOCK: tl.constexpr):
    """``out = bytes [offset, offset + count)`` after the base address: raw offset indexing."""
    for start in range(0, count, BLOCK):
        index = start + tl.arange(0, BLOCK)
        mask = index < count
        tl.store(out_ptr + index, tl.load(base_ptr + offset + index, mask=mask), mask=mask)


def read_entry(tensor: torch.Tensor, entry: int) -> torch.Tensor:
    """Entry ``entry`` of ``tensor`` read by address arithmetic only: base + entry * entry_bytes."""
    entry_bytes = tensor[0].nbytes
    base = tensor.reshape(-1).view(torch.uint8)
    assert base.data_ptr() == tensor.data_ptr()  # the kernel gets the tensor's own address
    out = torch.empty(entry_bytes, dtype=torch.uint8, device=tensor.device)
    _read_bytes[(1,)](base, out, entry * entry_bytes, entry_bytes, BLOCK=256)
    return out.cpu()


def providers(device: str, mode: str):
    weights = random_weights(9, 16, 8, extras=True, generator=torch.Generator().manual_seed(1))
    private = CachedWeightProvider(weights, cache_size=4, device=device, mode=mode)
    pool = SlotPool.for_weights(weights, 9, device=device, mode=mode)  # a share of 4 slots a layer
    shared = [CachedWeightProvider(weights, pool=pool, layer=index) for index in range(2)]
    return weights, [private, *shared]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["host", "device"])
def test_slot_tensors_are_contiguous_and_indexable_by_address(device, mode):
    weights, cached = providers(device, mode)
    gen = torch.Generator().manual_seed(2)
    for step in range(12):
        provider = cached[step % 3]
        result = provider.prepare(random_topk(2, 2, 9, generator=gen).to(device))
        tensors = {"w1": result.w1, "w2": result.w2, "w1_scale": result.w1_scale, "w2_scale": result.w2_scale}
        tensors.update(result.extra)
        assert result.num_slots == provider.pool.num_slots
        assert all(t.is_contiguous() and t.shape[0] == result.num_slots for t in tensors.values())
        for expert in provider.resident():
            slot = provider.slot_of(expert)
            for name, tensor in tensors.items():
                expected = weights[name][expert].reshape(-1).view(torch.uint8)
                assert torch.equal(read_entry(tensor, slot), expected), (name, expert, slot)


@pytest.mark.parametrize("device", devices())
def test_full_provider_results_are_contiguous(device):
    weights = {k: v.to(device) for k, v in random_weights(5, 16, 8, extras=True).items()}
    result = FullGPUProvider(weights).prepare(torch.tensor([[0, 4]], device=device))
    assert result.num_slots == 5
    assert all(t.is_contiguous() for t in (result.w1, result.w2, result.w1_scale, result.w2_scale))
    assert torch.equal(read_entry(result.w2, 4), weights["w2"][4].reshape(-1).view(torch.uint8).cpu())
    strided = dict(weights, w1=weights["w1"].transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="not contiguous"):
        FullGPUProvider(strided)
