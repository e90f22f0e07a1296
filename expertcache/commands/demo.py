"""``expertcache demo``: the embedded default job (no download; GPU if present, else CPU).

On a GPU it also decodes through CUDA graphs (`GraphedGenerator`); ``--no-graphs`` skips that.
"""

from __future__ import annotations

import argparse
import sys

from expertcache.commands.arguments import check_sequence_length, device_name, output_file, positive_int

#: Prompt length of the demo's runs (random token ids).
PROMPT_TOKENS = 24


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="generate with a random transformers MoE model, with and without the cache",
        description="Build a scaled-down MoE model from a transformers config class (random "
        "weights, no download), generate greedily without the cache and with it at several "
        "sizes, and compare.",
    )
    parser.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--family",
        default="qwen3_moe",
        # random_models.FAMILIES, not imported here: that would load transformers to parse flags
        choices=("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"),
        help="model family to build (default: qwen3_moe)",
    )
    parser.add_argument(
        "--new-tokens", type=positive_int, default=32, help="tokens to generate (default 32, at least 1)"
    )
    parser.add_argument(
        "--save-trace",
        type=output_file(),
        default=None,
        metavar="FILE.npz",
        help="keep the recorded routing trace in exactly this file (default: a temporary file)",
    )
    parser.add_argument(
        "--no-graphs",
        dest="graphs",
        action="store_false",
        default=None,
        help="on a GPU, skip the runs decoded through CUDA graphs (GraphedGenerator)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from expertcache.demo import DEMO_SIZES, run_demo
    from expertcache.integrations.transformers.random_models import random_config

    if args.graphs is False and not _on_cuda(args.device):
        print(
            "expertcache demo: warning: --no-graphs has no effect here: the demo runs on the CPU, "
            "where it makes no graphed runs to skip",
            file=sys.stderr,
        )
    model_config = random_config(args.family, DEMO_SIZES)  # no weights: built in run_demo
    check_sequence_length(model_config, PROMPT_TOKENS, args.new_tokens, "--new-tokens")
    rows = run_demo(
        family=args.family,
        device=args.device,
        new_tokens=args.new_tokens,
        prompt_tokens=PROMPT_TOKENS,
        trace_path=args.save_trace,
        graphs=args.graphs,  # None: on CUDA
    )
    return 0 if all(row.identical for row in rows) else 1


def _on_cuda(device) -> bool:
    """Whether the demo runs on a CUDA GPU: ``--device`` (a `torch.device`), else the GPU if any."""
    import torch

    return device.type == "cuda" if device is not None else torch.cuda.is_available()
