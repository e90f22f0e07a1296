"""The ``expertcache`` command line, and the cache flags any engine can adopt.

Each subcommand lives in its own module under `expertcache.commands` with a
``register(subparsers)`` function that adds its parser and sets ``func(args) -> int``.

An engine adopts the cache's flags in two lines::

    add_cache_arguments(parser)                                        # --moe-* flags
    handle = enable_expert_cache(model, cache_config_from_args(args))  # None: cache off
"""

from __future__ import annotations

import argparse
import importlib
import sys

from expertcache.config import BUDGETS, DEFAULT_BUDGET, MODES, ExpertCacheConfig, parse_byte_size
from expertcache.policies import POLICIES

#: Modules that provide subcommands, in the order ``--help`` lists them.
COMMAND_MODULES = ("expertcache.commands.demo", "expertcache.commands.generate", "expertcache.commands.plan")


def add_cache_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the expert-cache flags to an engine's parser, in their own group.

    ``--moe-expert-cache-size N`` (GPU slots per MoE layer; absent: no cache),
    ``--moe-expert-cache-policy`` (eviction policy), ``--moe-expert-cache-budget``
    (``per-layer`` or ``global``), ``--moe-expert-cache-mode`` (``host`` or ``device``) and
    ``--moe-pin-budget`` (e.g. ``64GiB``). Malformed values
    are rejected by the parser at once.
    """
    group = parser.add_argument_group("expert cache (serve MoE experts from host memory)")
    group.add_argument(
        "--moe-expert-cache-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="GPU slots per MoE layer (between the router's top-k and the experts per layer); "
        "omit to keep every expert on the GPU",
    )
    group.add_argument(
        "--moe-expert-cache-policy",
        choices=sorted(POLICIES),
        default="lru",
        help="eviction policy (default: lru)",
    )
    group.add_argument(
        "--moe-expert-cache-budget",
        choices=BUDGETS,
        default=DEFAULT_BUDGET,
        help="per-layer: N slots for each layer; global: one pool of N x layers slots that all "
        f"layers share (default: {DEFAULT_BUDGET})",
    )
    group.add_argument(
        "--moe-expert-cache-mode",
        choices=MODES,
        default="host",
        help="host: admission on the host, any policy; device: admission on the GPU (lru only), "
        "no host sync, CUDA-graph capturable (default: host)",
    )
    group.add_argument(
        "--moe-pin-budget",
        type=_byte_size,
        default=None,
        metavar="BYTES",
        help="most host memory to pin for the experts, e.g. 64GiB (default: no limit)",
    )
    return group


def cache_config_from_args(args: argparse.Namespace) -> ExpertCacheConfig | None:
    """The `ExpertCacheConfig` the flags describe, or None when ``--moe-expert-cache-size``
    was not given (the cache is off).

    Raises:
        ValueError: a combination the flags' own parsing could not reject.
    """
    if args.moe_expert_cache_size is None:
        return None
    return ExpertCacheConfig(
        cache_size=args.moe_expert_cache_size,
        policy=args.moe_expert_cache_policy,
        budget=args.moe_expert_cache_budget,
        pin_budget_bytes=args.moe_pin_budget,
        mode=args.moe_expert_cache_mode,
    )


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
