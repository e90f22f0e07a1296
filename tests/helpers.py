"""Builders shared by the tests: random expert weights and routing, checkpoints, trace
folders (`process_groups` holds the torch.distributed process groups)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

#: The benchmark scripts' folder (not a package: its modules import each other by name).
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def bench_module(name: str):
    """Import ``benchmarks/<name>.py`` as a module (its folder on ``sys.path`` while it loads)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def real_traces() -> Path:
    """The real routing traces where the benchmarks find them (``$EXPERTCACHE_TRACES``,
    ``../shared/traces``, the carried ``.traces/``); a missing folder when none is there
    (the tests that read them skip)."""
    try:
        return bench_module("_common").traces_dir()
    except FileNotFoundError:
        return BENCHMARKS.parents[1] / "shared" / "traces"


def random_weights(
    num_experts: int,
    hidden: int,
    inter: int,
    *,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    extras: bool = False,
) -> dict[str, torch.Tensor]:
    """``{"w1": [E, 2I, H], "w2": [E, H, I]}`` (plus scales and a bias when ``extras``)."""
    weights = {
        "w1": torch.randn(num_experts, 2 * inter, hidden, generator=generator).to(dtype) / hidden**0.5,
        "w2": torch.randn(num_experts, hidden, inter, generator=generator).to(dtype) / inter**0.5,
    }
    if extras:
        weights["w1_scale"] = torch.rand(num_experts, generator=generator) + 0.5
        weights["w2_scale"] = torch.rand(num_experts, 3, generator=generator) + 0.5
        weights["bias"] = torch.randn(num_experts, hidden, generator=generator).to(dtype)
    return weights


def random_topk(tokens: int, top_k: int, num_experts: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[T, K]`` int64 ids, distinct within each row (as a router's top-k)."""
    scores = torch.rand(tokens, num_experts, generator=generator)
    return scores.topk(top_k, dim=-1).indices


def cached_and_full_stacks(
    gen: torch.Generator,
    *,
    tokens: int,
    cache_size: int,
    device: str = "cuda",
    layers: int = 3,
    lookahead: int = 1,
    across_steps: bool = False,
):
    """Two `DecodeStack` s of one function (``layers`` layers of 16 experts, H=64, top-4,
    bf16): over device-mode caches of ``cache_size`` slots (prefetching ``lookahead`` layers
    ahead, into the next step with ``across_steps``) and over resident weights.

    Returns ``(cached providers, (cached stack, full stack), routing)``, where ``routing()``
    draws a fresh ``[layers, tokens, 4]`` step of ids on ``device``.
    """
    from expertcache import CachedWeightProvider, FullGPUProvider
    from expertcache.decode_stack import DecodeStack

    num_experts, hidden_size, top_k = 16, 64, 4
    weights = [random_weights(num_experts, hidden_size, 32, dtype=torch.bfloat16, generator=gen) for _ in range(layers)]
    cached = [CachedWeightProvider(w, cache_size=cache_size, mode="device", device=device) for w in weights]
    full = [FullGPUProvider({n: t.to(device) for n, t in w.items()}) for w in weights]
    stacks = (
        DecodeStack(
            cached,
            hidden_size,
            num_experts,
            dtype=torch.bfloat16,
            device=device,
            lookahead=lookahead,
            across_steps=across_steps,
        ),  # fmt: skip
        DecodeStack(full, hidden_size, num_experts, dtype=torch.bfloat16, device=device),
    )

    def routing() -> torch.Tensor:
        return torch.stack([random_topk(tokens, top_k, num_experts, generator=gen) for _ in range(layers)]).to(device)

    return cached, stacks, routing


def slot_bytes(pool) -> dict[str, torch.Tensor]:
    """A copy of every slot tensor of ``pool``, as bytes on the CPU."""
    return {name: t.detach().reshape(-1).view(torch.uint8).cpu().clone() for name, t in pool.tensors.items()}


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def addresses(pool) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in pool.tensors.items()}


def views(provider) -> tuple:
    """Everything a provider's public read-only views say: stats, resident set, both tables."""
    return (
        provider.stats,
        provider.resident(),
        [provider.slot_of(e) for e in range(provider.num_experts)],
        [provider.expert_in(s) for s in range(provider.pool.num_slots)],
    )


def synthetic_qwen3_traces(folder, *, tokens: int = 24, layers: int = 12, seed: int = 0):
    """A stand-in for ``shared/traces`` where it is absent (CI): the Qwen3-30B-A3B trace's
    folder and record format (one JSONL record per token and layer, 8 distinct expert ids of
    128), seeded random routing. Returns the folder to set as ``$EXPERTCACHE_TRACES``."""
    import json
    from pathlib import Path

    generator = torch.Generator().manual_seed(seed)
    window = Path(folder) / "qwen3-30b-a3b-instruct-2507__local-moe-inference-stack" / "window_0.jsonl"
    window.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for position in range(tokens):
        for layer in range(layers):
            experts = torch.randperm(128, generator=generator)[:8].tolist()
            lines.append(json.dumps({"prompt_id": 0, "token_pos": position, "layer": layer, "experts": experts}))
    window.write_text("\n".join(lines) + "\n")
    return Path(folder)


def traces_env(folder) -> dict[str, str]:
    """``os.environ`` for a benchmark subprocess, with ``$EXPERTCACHE_TRACES`` pointing at
    synthetic traces in ``folder`` when the real ones (``../shared/traces``, ``.traces``) are absent."""
    import os

    if real_traces().is_dir():
        return dict(os.environ)
    return {**os.environ, "EXPERTCACHE_TRACES": str(synthetic_qwen3_traces(folder))}


def checkpoint_with(checkpoint: Path, folder: Path, **fields) -> Path:
    """``checkpoint``'s config with ``fields`` changed, beside a link to its weights (a
    ``model.safetensors`` checkpoint folder); returns ``folder``."""
    config = json.loads((checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    (folder / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    return folder
