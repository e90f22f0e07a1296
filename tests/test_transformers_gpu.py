"""The transformers integration on a CUDA GPU (bf16): memory moves, pinning, the demo.

The per-family bf16 equivalence runs in `test_transformers_families` (its ``cuda-bf16``
cases); these cover what only a GPU can show.
"""

from __future__ import annotations

import pytest
import torch
from transformers_helpers import NEW_TOKENS, TINY, logits_of, prompt, tiny_model

from expertcache.integrations.transformers import enable_expert_cache
from expertcache.integrations.transformers.generation import greedy_generate
from expertcache.integrations.transformers.random_models import ModelSizes, random_model

pytestmark = pytest.mark.gpu


def test_host_loaded_model_with_slots_on_the_gpu():
    """The README's flow: load on the host, enable with device='cuda', move the rest."""
    resident = tiny_model("qwen3_moe", dtype=torch.bfloat16, device="cuda")
    resident.set_experts_implementation("batched_mm")
    reference = greedy_generate(resident, prompt(device="cuda"), NEW_TOKENS)
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)  # same seed: same weights, on host
    model.set_experts_implementation("batched_mm")
    handle = enable_expert_cache(model, cache_size=4, device="cuda")
    model.to("cuda")
    cached = greedy_generate(model, prompt(device="cuda"), NEW_TOKENS)
    assert torch.equal(cached.tokens, reference.tokens)
    layer = handle.layers[0]
    assert handle.provider(layer).store.pinned
    handle.disable()
    assert model.get_parameter(f"{layer}.gate_up_proj").device.type == "cuda"
    tokens = reference.tokens.cuda()
    assert torch.equal(logits_of(model, tokens), logits_of(resident, tokens))


@pytest.mark.parametrize("budget", ["per-layer", "global"])
def test_the_gpu_keeps_only_the_slots(budget):
    sizes = ModelSizes(num_moe_layers=2, num_experts=32, top_k=4, hidden=256, intermediate=512)
    model = random_model("mixtral", sizes, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = enable_expert_cache(model, cache_size=8, budget=budget)
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    assert handle.slot_bytes < handle.expert_bytes / 3
    # every expert weight left the GPU; the slots (and id tables of a few KB) came instead
    assert freed >= handle.expert_bytes - handle.slot_bytes - 2**20
    handle.disable()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() >= before


def test_demo_on_the_gpu_is_identical(tmp_path):
    from expertcache.demo import run_demo

    rows = run_demo(device="cuda", new_tokens=8, sizes=TINY, trace_path=tmp_path / "t.npz")
    assert all(row.identical for row in rows)
    assert all(row.run.peak_bytes for row in rows)


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager", "batched_mm"])
def test_every_experts_implementation_on_the_gpu(implementation):
    """transformers' CUDA kernels accept the slot buffers' strides (records of 256-byte multiples)."""
    model = tiny_model("gpt_oss", dtype=torch.bfloat16, device="cuda")
    model.set_experts_implementation(implementation)
    tokens = prompt(device="cuda")
    reference = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=4, budget="global")
    cached = logits_of(model, tokens)
    handle.disable()
    scale = reference.abs().max().item()
    torch.testing.assert_close(cached, reference, rtol=0, atol=2e-2 * scale)
