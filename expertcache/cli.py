"""The ``expertcache`` command line: ``expertcache demo`` runs the embedded default job."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertcache",
        description="Serve Mixture-of-Experts weights from host memory through a GPU slot cache.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the self-contained demo (no GPU, no download)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    demo.add_argument("--steps", type=int, default=64, help="decode steps (default 64)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from expertcache.demo_layers import StackConfig, run_demo

        if args.steps < 1:
            print("expertcache demo: --steps must be at least 1", file=sys.stderr)
            return 2
        rows = run_demo(StackConfig(steps=args.steps), device=args.device)
        return 0 if all(row["identical"] for row in rows) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
