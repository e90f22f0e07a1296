"""The Triton remap kernel equals its torch reference exactly (interpreted on CPU, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import devices

from expertcache.kernels import remap_topk_ids, remap_topk_ids_torch


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("map_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "tokens, top_k, num_entries",
    [
        (1, 1, 1),  # smallest call: one token, top-1, one-entry table
        (1, 8, 128),  # decode step of a Qwen3-30B-A3B layer
        (7, 13, 13),  # K = E, prime E
        (4096, 8, 128),  # prefill: several kernel blocks, last one partial
        (0, 4, 16),  # empty batch: nothing to launch
    ],
)
def test_remap_matches_reference(device, id_dtype, map_dtype, tokens, top_k, num_entries):
    gen = torch.Generator().manual_seed(tokens * 1000 + top_k)
    ids = torch.randint(-1, num_entries, (tokens, top_k), generator=gen).to(id_dtype)
    mapping = torch.randint(-1, 1000, (num_entries,), generator=gen).to(map_dtype)
    ids, mapping = ids.to(device), mapping.to(device)
    expected = torch.where(ids >= 0, mapping.to(id_dtype)[ids.clamp(min=0)], -1)
    out = remap_topk_ids(ids, mapping)
    assert out.dtype == id_dtype and out.shape == ids.shape
    assert torch.equal(out, expected)
    assert torch.equal(remap_topk_ids_torch(ids, mapping), expected)


@pytest.mark.parametrize("device", devices())
def test_remap_writes_every_element_of_out(device):
    ids = torch.tensor([[0, 1, -1], [2, 2, 0]], device=device)
    mapping = torch.tensor([5, -1, 7], dtype=torch.int32, device=device)
    out = torch.full((2, 3), -12345, dtype=torch.int32, device=device)  # poison
    returned = remap_topk_ids(ids, mapping, out=out)
    assert returned is out
    assert out.tolist() == [[5, -1, -1], [7, 7, 5]]


@pytest.mark.parametrize("device", devices())
def test_remap_ids_outside_the_table_become_minus_one(device):
    ids = torch.tensor([[3, 100, -1, -7]], device=device)
    mapping = torch.arange(4, dtype=torch.int32, device=device)
    assert remap_topk_ids(ids, mapping).tolist() == [[3, -1, -1, -1]]


@pytest.mark.parametrize("device", devices())
def test_remap_non_contiguous_ids(device):
    ids = torch.arange(24, device=device).reshape(4, 6)[:, ::2]  # strided view
    mapping = torch.arange(24, dtype=torch.int32, device=device).flip(0)
    assert torch.equal(remap_topk_ids(ids, mapping), 23 - ids)


@pytest.mark.parametrize(
    "ids, mapping, out, error",
    [
        (torch.zeros(2, 2), torch.zeros(3, dtype=torch.int32), None, TypeError),  # float ids
        (torch.zeros(2, 2, dtype=torch.long), torch.zeros(3), None, TypeError),  # float table
        (torch.zeros(2, 2, dtype=torch.long), torch.zeros(3, 1, dtype=torch.int32), None, ValueError),
        (
            torch.zeros(2, 2, dtype=torch.long),
            torch.zeros(3, dtype=torch.int32),
            torch.zeros(4, dtype=torch.long),  # wrong out shape
            ValueError,
        ),
        (
            torch.zeros(2, 2, dtype=torch.long),
            torch.zeros(3, dtype=torch.int32, device="meta"),  # another device
            None,
            ValueError,
        ),
    ],
)
def test_remap_rejects_bad_input(ids, mapping, out, error):
    with pytest.raises(error):
        remap_topk_ids(ids, mapping, out=out)
