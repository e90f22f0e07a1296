"""README.md's examples, run: every ```python block executes, at tiny shapes, and keeps what the
prose around it promises; every ``expertcache <command> --flag`` and every repository path it
shows exists.

A block leaves some names to the reader (the weights, the router's ids, a fused-MoE kernel, a
model): `_namespace` supplies them. `CHECKS` holds what a block's prose promises about the names
it leaves behind. Blocks that need a GPU or a download are listed in `SKIPPED` with the reason;
their imports still run and their calls of what they import must fit the signatures.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import urllib.request
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import expertcache.metrics
from expertcache import CachedWeightProvider, CacheStats
from expertcache.cli import add_cache_arguments, build_parser, cache_config_from_args
from expertcache.kernels.grouped_apply import moe_apply_auto
from expertcache.manifest import Manifest
from expertcache.reference import moe_forward

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = [
    (README[: match.start()].count("\n") + 1, match.group(1))
    for match in re.finditer(r"^```python\n(.*?)^```", README, re.S | re.M)
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, INTER, K = 64, 32, 16, 2  # experts, hidden, intermediate, top-k: README's 32 slots need E >= 32

#: A stable substring of each block that is not run -> why.
SKIPPED = {
    "GraphedDecodeStep(stack": "captures a CUDA graph",
    'enable_expert_cache(model, cache_size=32, device="cuda")': "slots on a CUDA GPU, and a checkpoint `path`",
    "load_mxfp4_experts(model, gpt_oss_path)": "downloads FP8 and MXFP4 checkpoints (and needs a GPU)",
    "runner = GraphedGenerator(": "CUDA graphs, a CUDA generator",
}


def _namespace(tokens: int) -> dict[str, object]:
    """The names README's blocks leave to the reader: tiny, seeded; ids on the cache's device."""
    gen = torch.Generator().manual_seed(0)
    w13_weight, w2_weight = torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER, generator=gen)
    experts = {"w1": w13_weight, "w2": w2_weight}
    topk_ids = torch.randperm(E, generator=gen)[: tokens * K].view(tokens, K)  # distinct experts
    return {
        "w13_weight": w13_weight,
        "w2_weight": w2_weight,
        "weights": {"w1": w13_weight.bfloat16(), "w2": w2_weight.bfloat16()},  # what exponent coding takes
        "topk_ids": topk_ids.to(DEVICE),
        "topk_weights": torch.rand(tokens, K, generator=gen).to(DEVICE),
        "hidden": torch.randn(tokens, H, generator=gen).to(DEVICE),
        "fused_moe": moe_forward,
        "provider": CachedWeightProvider(experts, cache_size=32),
        "next_layer_provider": CachedWeightProvider(experts, cache_size=32, mode="device"),
        "predicted_ids": topk_ids[0].to(DEVICE),
        "layer0": CachedWeightProvider(experts, cache_size=32),
        "layer1": CachedWeightProvider(experts, cache_size=32),
    }


def _engine(ns: dict) -> None:
    """The engine's parser, its parsed flags and a model (8 experts, top-2), for the two lines."""
    from expertcache.integrations.transformers.random_models import random_model

    engine = argparse.ArgumentParser()
    add_cache_arguments(engine)
    ns.update(parser=argparse.ArgumentParser(), args=engine.parse_args(["--moe-expert-cache-size", "4"]))
    ns["model"] = random_model("qwen3_moe")


def _prepared(ns: dict) -> None:
    result, ids = ns["result"], ns["topk_ids"]
    assert result.num_slots == 32 and result.w1.shape == (32, 2 * INTER, H) and result.w2.shape == (32, H, INTER)
    assert result.w1.is_contiguous() and result.w2.is_contiguous()  # the contract's layout
    full = moe_forward(ns["hidden"], ns["w13_weight"].to(DEVICE), ns["w2_weight"].to(DEVICE), ns["topk_weights"], ids)
    torch.testing.assert_close(ns["out"], full)
    copied = ids.numel() * (2 * INTER * H + H * INTER) * 4  # every id a miss: fp32 w1 and w2 of each
    assert ns["provider"].stats == CacheStats(
        misses=ids.numel(), bytes_h2d=copied, calls=1, compressed_bytes_h2d=copied
    )
    listed = re.search(r"print\(provider\.stats\)  # (.*)", README).group(1)  # the fields the comment names
    assert listed.split(", ") == [field.name for field in fields(CacheStats)]


def _passes(ns: dict) -> None:
    full = [ns["w13_weight"].to(DEVICE), ns["w2_weight"].to(DEVICE)]
    one_call = moe_apply_auto(ns["hidden"], *full, ns["topk_weights"], ns["topk_ids"])
    assert torch.equal(ns["out"], one_call)  # "bit-identical to one call"
    assert len(list(ns["provider"].passes(ns["topk_ids"]))) > 1  # the call did not fit: several passes


def _prefetched(ns: dict) -> None:
    provider, ids = ns["next_layer_provider"], ns["predicted_ids"]
    assert provider.prefetch_stats.misses == ids.numel() and provider.prefetch_stats.hits == 0
    provider.prepare(ids.view(1, -1))  # the layer's next call finds them resident
    assert (provider.stats.hits, provider.stats.misses) == (ids.numel(), 0)


def _engine_lines(ns: dict) -> None:
    from expertcache.integrations.transformers import enable_expert_cache

    ns["cache"].disable()
    assert enable_expert_cache(ns["model"], cache_config_from_args(ns["parser"].parse_args([]))) is None
    given = {flag for action in ns["parser"]._actions for flag in action.option_strings}
    assert set(re.findall(r"--moe-[a-z-]+[a-z]", README)) <= given  # every --moe-* flag README names


def _metrics(ns: dict) -> None:
    assert Manifest.read("manifest.json") == ns["manifest"]
    ns["layer0"].prepare(ns["topk_ids"])
    with urllib.request.urlopen(f"http://127.0.0.1:{ns['server'].port}/metrics", timeout=10) as response:
        scraped = response.read().decode()
    ns["server"].close()
    for families, rest in re.findall(r"# (expertcache_\{([a-z_,]+)\}_total|expertcache_[a-z_]+)", README):
        names = [f"expertcache_{name}_total" for name in rest.split(",")] if rest else [families]
        assert all(f"# HELP {name} " in scraped for name in names), names
    assert 'expertcache_hits_total{layer="1"} 0.0' in scraped


def _compressed(ns: dict) -> None:
    provider, ids = ns["provider"], ns["topk_ids"]
    assert ns["config"].compression == "exponent"
    assert provider.manifest().compressed_expert_bytes < provider.manifest().expert_bytes
    result = provider.prepare(ids)
    assert torch.equal(result.w1[result.topk_ids].cpu(), ns["weights"]["w1"][ids.cpu()])  # exact 16-bit words
    assert provider.stats.compressed_bytes_h2d < provider.stats.bytes_h2d


#: A stable substring of a block -> (tokens of its call, names to add first or None, what to assert after).
CHECKS = {
    "result = provider.prepare(topk_ids)": (4, None, _prepared),
    "moe_apply_passes(hidden, provider.passes(topk_ids)": (24, None, _passes),  # 48 experts > 32 slots
    "next_layer_provider.prefetch(predicted_ids)": (4, None, _prefetched),
    "add_cache_arguments(parser)": (4, _engine, _engine_lines),
    "start_metrics_server(9400": (4, None, _metrics),
    'compression="exponent")': (4, None, _compressed),
}


def _key(table: dict, block: str) -> str | None:
    keys = [key for key in table if key in block]
    assert len(keys) <= 1, f"keys {keys} all match one block"
    return keys[0] if keys else None


def _check_skipped(block: str) -> None:
    """A block that is not run: its imports run, and its calls of what they import fit the signatures."""
    tree = ast.parse(block)
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    names: dict[str, object] = {}
    exec(compile(ast.Module(body=imports, type_ignores=[]), "README.md", "exec"), names)
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        imported = names.get(call.func.id) if isinstance(call.func, ast.Name) else None
        if callable(imported):  # refuses a keyword the function lacks, or too many arguments
            inspect.signature(imported).bind(*call.args, **{keyword.arg: None for keyword in call.keywords})


@pytest.mark.parametrize("line, block", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs(line, block, tmp_path, monkeypatch):
    reason = SKIPPED.get(_key(SKIPPED, block) or "")
    if reason is not None:
        _check_skipped(block)
        pytest.skip(f"README.md:{line} not run: {reason}")
    tokens, setup, check = CHECKS.get(_key(CHECKS, block) or "", (4, None, None))
    monkeypatch.chdir(tmp_path)  # files a block writes
    serve = expertcache.metrics.start_metrics_server  # on any free port: 9400 may be taken here
    monkeypatch.setattr(expertcache.metrics, "start_metrics_server", lambda port, *a, **kw: serve(0, *a, **kw))
    ns = _namespace(tokens)
    if setup is not None:
        setup(ns)
    exec(compile(block, f"README.md:{line}", "exec"), ns)
    if check is not None:
        check(ns)


def test_every_skipped_and_checked_block_is_in_readme():
    for key in [*SKIPPED, *CHECKS]:
        assert sum(key in block for _, block in BLOCKS) == 1, f"{key!r} names no README block, or several"


def _commands() -> list[str]:
    """Every ``expertcache <command> ...`` README shows: in shell blocks (continuation lines
    joined) and in inline code."""
    shown = re.findall(r"`(?:python -m )?(expertcache [a-z][^`]*)`", README)
    for block in re.findall(r"^```bash\n(.*?)^```", README, re.S | re.M):
        joined = re.sub(r"\\?\n[ \t]+", " ", block)  # a line that starts indented continues the one before
        shown += re.findall(r"(expertcache [a-z](?:(?!&&)[^\n])*)", joined)  # up to the line's end or &&
    return shown


def test_every_command_line_flag_readme_shows_exists():
    subparsers = next(action for action in build_parser()._actions if action.dest == "command").choices
    commands = _commands()
    assert {command.split()[1] for command in commands} >= {"demo", "generate", "plan"}
    for command in commands:
        name = command.split()[1]
        assert name in subparsers, f"README shows {command!r}: no such command"
        flags = {flag for action in subparsers[name]._actions for flag in action.option_strings}
        missing = set(re.findall(r"--[a-z][a-z0-9-]*", command)) - flags
        assert not missing, f"README shows {command!r}: expertcache {name} has no {sorted(missing)}"


def test_every_repository_path_readme_names_exists():
    for path in re.findall(r"`((?:expertcache|benchmarks|tests|\.ci)/[^`\s]*)`", README):
        head, _, rest = path.partition("{")
        choices, _, tail = rest.partition("}")
        for each in [head + choice + tail for choice in choices.split(",")] if rest else [path]:
            assert list(ROOT.glob(each.rstrip("/"))), f"README names {each}, which does not exist"
    for name in set(re.findall(r"`([a-z0-9_]+\.(?:py|sh))`", README)):  # a bare file name (the Layout table)
        assert any((ROOT / top).rglob(name) for top in ("expertcache", "benchmarks", "tests")), f"no {name}"
