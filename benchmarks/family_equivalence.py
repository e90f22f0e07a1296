"""Per-family equivalence with and without the cache, printed as a table (not a speed test).

For every required family: a tiny random model (2 MoE layers, 8 experts, top-2) generates
16 greedy tokens without the cache and with 4 slots per layer (both budgets); the table
shows whether the tokens are identical, the largest logit difference over the whole
sequence (absolute, and relative to the largest logit), the cache's hits, misses and
evictions, and whether ``disable()`` gave back bit-identical logits. fp32 on the CPU, bf16
on CUDA (``batched_mm`` experts on CUDA, see `expertcache.demo`).

    python benchmarks/family_equivalence.py [--device cuda]
"""

from __future__ import annotations

import argparse

import torch
import transformers
from _common import environment

from expertcache.config import BUDGETS
from expertcache.integrations.transformers import enable_expert_cache
from expertcache.integrations.transformers.generation import greedy_generate
from expertcache.integrations.transformers.random_models import FAMILIES, ModelSizes, random_model

SIZES = ModelSizes(num_moe_layers=2, num_experts=8, top_k=2)
CACHE_SIZE, NEW_TOKENS = 4, 16


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def compare(family: str, budget: str, device: torch.device, dtype: torch.dtype) -> dict:
    model = random_model(family, SIZES, dtype=dtype, device=device)
    if device.type == "cuda":
        model.set_experts_implementation("batched_mm")
    prompt = torch.randint(0, SIZES.vocab, (1, 12), generator=torch.Generator().manual_seed(7))
    prompt = prompt.to(device)
    reference = greedy_generate(model, prompt, NEW_TOKENS)
    sequence = reference.tokens.to(device)
    before = _logits(model, sequence)
    handle = enable_expert_cache(model, cache_size=CACHE_SIZE, budget=budget)
    cached = greedy_generate(model, prompt, NEW_TOKENS)
    with_cache = _logits(model, sequence)
    stats = handle.stats.total
    handle.disable()
    difference = (with_cache - before).abs().max().item()
    return {
        "family": family,
        "budget": budget,
        "tokens identical": bool(torch.equal(cached.tokens, reference.tokens)),
        "max |dlogit|": difference,
        "relative": difference / before.abs().max().item(),
        "hits": stats.hits,
        "misses": stats.misses,
        "evictions": stats.evictions,
        "disable exact": bool(torch.equal(_logits(model, sequence), before)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    device = torch.device(parser.parse_args().device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    env = environment()
    print(
        f"{env['gpu']}; torch {env['torch']}, transformers {transformers.__version__}, commit "
        f"{env['commit']}; {str(dtype).removeprefix('torch.')}, {NEW_TOKENS} new tokens, "
        f"cache {CACHE_SIZE} of {SIZES.num_experts} experts per layer"
    )
    rows = [compare(f, b, device, dtype) for f in FAMILIES for b in BUDGETS]
    print(
        f"{'family':<12} {'budget':<9} {'tokens ==':>9} {'max |dlogit|':>12} {'relative':>9} "
        f"{'hits':>5} {'misses':>6} {'evict':>6} {'disable exact':>13}"
    )
    for r in rows:
        print(
            f"{r['family']:<12} {r['budget']:<9} {'yes' if r['tokens identical'] else 'NO':>9} "
            f"{r['max |dlogit|']:>12.3g} {r['relative']:>9.2g} {r['hits']:>5} {r['misses']:>6} "
            f"{r['evictions']:>6} {'yes' if r['disable exact'] else 'NO':>13}"
        )


if __name__ == "__main__":
    main()
