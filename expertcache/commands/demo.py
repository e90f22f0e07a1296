"""``expertcache demo``: the embedded default job (no GPU, no download)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the self-contained demo (no GPU, no download)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--steps", type=_positive_int, default=64, help="decode steps (default 64)")
    parser.set_defaults(func=run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from expertcache.demo_layers import StackConfig, run_demo

    rows = run_demo(StackConfig(steps=args.steps), device=args.device)
    return 0 if all(row["identical"] for row in rows) else 1
