"""The ``expertcache`` command line.

Each subcommand lives in its own module under `expertcache.commands` with a
``register(subparsers)`` function that adds its parser and sets ``func(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Modules that provide subcommands, in the order ``--help`` lists them.
COMMAND_MODULES = ("expertcache.commands.demo", "expertcache.commands.plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertcache",
        description="Serve Mixture-of-Experts weights from host memory through a GPU slot cache.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
