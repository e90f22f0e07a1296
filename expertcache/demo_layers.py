"""The embedded default job: a random MoE layer stack served through the cache.

No download and no GPU needed. A stack of random MoE layers decodes a stream of
temporally correlated tokens (so routing has the locality real models show), once with
every expert resident and once per cache size; it prints hit rates, bytes moved and
whether the outputs equal the fully resident run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from expertcache.cached_provider import CachedWeightProvider
from expertcache.provider import ExpertWeightProvider, FullGPUProvider
from expertcache.reference import moe_forward
from expertcache.slot_pool import SlotPool
from expertcache.stats import CacheStats


@dataclass(frozen=True, slots=True)
class StackConfig:
    """Shape of the random stack (L layers of E experts, top-K, hidden H, intermediate I)."""

    num_layers: int = 4
    num_experts: int = 32
    top_k: int = 4
    hidden: int = 256
    inter: int = 512
    steps: int = 64
    seed: int = 0


class RandomMoEStack:
    """L random MoE layers with routers whose expert popularity is skewed."""

    def __init__(self, config: StackConfig, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(config.seed)
        L, E, H, inter = config.num_layers, config.num_experts, config.hidden, config.inter
        self.config, self.device = config, device
        self.experts = [
            {
                "w1": torch.randn(E, 2 * inter, H, generator=gen) / H**0.5,
                "w2": torch.randn(E, H, inter, generator=gen) / inter**0.5,
            }
            for _ in range(L)
        ]
        popularity = -torch.arange(E, dtype=torch.float32).log1p()  # Zipf-like skew
        self.routers = [
            (torch.randn(H, E, generator=gen).to(device), popularity[torch.randperm(E, generator=gen)].to(device))
            for _ in range(L)
        ]
        self.tokens = self._token_stream(gen)

    def _token_stream(self, gen: torch.Generator) -> torch.Tensor:
        # x_t = 0.9 x_{t-1} + noise: neighbouring tokens route alike, as in real decoding
        x = torch.randn(self.config.hidden, generator=gen)
        out = []
        for _ in range(self.config.steps):
            x = 0.9 * x + 0.45 * torch.randn(self.config.hidden, generator=gen)
            out.append(x.clone())
        return torch.stack(out).to(self.device)

    def decode(self, providers: list[ExpertWeightProvider]) -> torch.Tensor:
        """Run every token through the stack one at a time; returns ``[steps, H]``."""
        outputs = []
        for token in self.tokens:
            h = token[None]
            for (router, bias), provider in zip(self.routers, providers, strict=True):
                logits = h @ router + bias
                weights, ids = logits.softmax(-1).topk(self.config.top_k, dim=-1)
                result = provider.prepare(ids)
                h = h + moe_forward(h, result.w1, result.w2, weights, result.topk_ids)
            outputs.append(h[0])
        return torch.stack(outputs)


def run_demo(config: StackConfig | None = None, device: str | None = None) -> list[dict]:
    """Decode with every cache size and print a table; returns its rows."""
    config = config or StackConfig()
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    stack = RandomMoEStack(config, target)
    E, L = config.num_experts, config.num_layers
    print(
        f"expertcache demo: {L} random MoE layers, {E} experts each, top-{config.top_k}, "
        f"H={config.hidden}, I={config.inter}, {config.steps} decode steps on {target}"
    )
    start = time.perf_counter()
    full = stack.decode([FullGPUProvider({k: v.to(target) for k, v in w.items()}) for w in stack.experts])
    rows = [_row("all resident", 1.0, [], full, full, time.perf_counter() - start)]
    for fraction in (0.25, 0.5, 1.0):
        slots = max(config.top_k, round(fraction * E))
        start = time.perf_counter()
        providers = [CachedWeightProvider(w, cache_size=slots, device=target) for w in stack.experts]
        out = stack.decode(providers)
        rows.append(_row(f"per-layer {slots}/{E}", fraction, providers, out, full, time.perf_counter() - start))
    pool = SlotPool.for_weights(stack.experts[0], L * E // 2, device=target)
    start = time.perf_counter()
    providers = [CachedWeightProvider(w, pool=pool, layer=i) for i, w in enumerate(stack.experts)]
    out = stack.decode(providers)
    rows.append(_row(f"global pool {L * E // 2}/{L * E}", 0.5, providers, out, full, time.perf_counter() - start))
    _print_table(rows)
    return rows


def _row(name, fraction, providers, out, full, seconds) -> dict:
    stats = sum((p.stats for p in providers), CacheStats())
    return {
        "cache": name,
        "fraction": fraction,
        "hit_rate": stats.hit_rate if providers else 1.0,
        "misses": stats.misses,
        "mb_copied": stats.bytes_h2d / 1e6,
        "max_abs_diff": float((out - full).abs().max()),
        "identical": bool(torch.equal(out, full)),
        "seconds": seconds,
    }


def _print_table(rows: list[dict]) -> None:
    header = (
        f"{'cache':<24} {'hit rate':>8} {'misses':>7} {'MB copied':>10} {'max |diff|':>11} "
        f"{'identical':>9} {'time s':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['cache']:<24} {r['hit_rate']:>8.1%} {r['misses']:>7} {r['mb_copied']:>10.1f} "
            f"{r['max_abs_diff']:>11.3g} {'yes' if r['identical'] else 'NO':>9} {r['seconds']:>7.2f}"
        )
