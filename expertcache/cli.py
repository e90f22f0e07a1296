"""The ``expertcache`` command line, and the cache flags any engine can adopt.

Each subcommand lives in its own module under `expertcache.commands` with a
``register(subparsers)`` function that adds its parser and sets ``func(args) -> int``.

An engine adopts the cache's flags in two lines::

    add_cache_arguments(parser)                                        # --moe-* flags
    handle = enable_expert_cache(model, cache_config_from_args(args))  # None: cache off

Errors are one line on stderr and exit status 2, never a traceback: a malformed flag is
refused by the parser (`CommandLineParser`), and `main` turns what a command raises for
bad input (ValueError, TypeError, OSError: a missing file, a malformed trace or manifest)
into ``expertcache <command>: error: <message>`` (a warning is one line too:
``expertcache <command>: warning: <message>``), and a missing optional package (the
``transformers`` extra) into a line saying how to install it, and a GPU out of memory
(`torch.OutOfMemoryError`) into a line saying how much torch tried to allocate and which flags
ask for less. Any other exception is a bug and keeps its traceback. A reader of the output that
goes away (``expertcache plan ... | head``) ends the command quietly, as it ends any tool.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

import torch

from expertcache.commands.arguments import device_name, positive_int
from expertcache.config import (
    BUDGETS,
    COMPRESSION_CHOICES,
    DEFAULT_BUDGET,
    MODES,
    RUNTIME_POLICY_NAMES,
    ExpertCacheConfig,
    check_mode_runs_here,
    parse_byte_size,
)

#: Modules that provide subcommands, in the order ``--help`` lists them.
COMMAND_MODULES = ("expertcache.commands.demo", "expertcache.commands.generate", "expertcache.commands.plan")

#: What a command raises for bad input; anything else is a bug and keeps its traceback.
EXPECTED_ERRORS = (ValueError, TypeError, OSError)

#: Optional packages a command may import -> the extra that installs them.
OPTIONAL_PACKAGES = {"transformers": "transformers"}

#: The exit status of a tool whose output pipe closed (killed by SIGPIPE: 128 + 13).
STATUS_PIPE_CLOSED = 141

__all__ = [
    "CommandLineParser",
    "add_cache_arguments",
    "build_parser",
    "cache_config_from_args",
    "describe_error",
    "main",
    "positive_int",
]


#: Where `_StoreOnce` notes the flags given so far (removed before the namespace is returned).
_GIVEN = "_expertcache_flags_given"


class _StoreOnce(argparse._StoreAction):
    """A flag that takes a value, refused when it comes twice (the stock parser keeps the
    last value and ignores the first, silently)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        given = vars(namespace).setdefault(_GIVEN, set())
        if option_string is not None and self.dest in given:
            parser.error(f"{'/'.join(self.option_strings)} given twice: give each flag once")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class CommandLineParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line, ``prog: error: message``, and
    which refuses a flag that takes a value given twice, and an abbreviated flag.

    (The stock parser prints its usage first; ``--help`` still shows it. It also takes any
    unambiguous prefix of a flag, ``--gpu`` for ``--gpu-budget``: a script written so would
    break, or change meaning, the day a flag sharing that prefix is added.) Subparsers made by
    ``add_subparsers`` are of this class too.
    """

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        namespace, extras = super().parse_known_args(args, namespace)
        vars(namespace).pop(_GIVEN, None)
        return namespace, extras

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def add_cache_arguments(parser: argparse.ArgumentParser, *, size_required: bool = False) -> argparse._ArgumentGroup:
    """Add the expert-cache flags to an engine's parser, in their own group.

    ``--moe-expert-cache-size N`` (GPU slots per MoE layer; absent: no cache, unless
    ``size_required``: a command that only runs with a cache, whose help says so),
    ``--moe-expert-cache-policy`` (eviction policy; simulation-only ones are not offered),
    ``--moe-expert-cache-budget`` (``per-layer`` or ``global``), ``--moe-expert-cache-mode``
    (``host`` or ``device``), ``--moe-expert-cache-device`` (where the slots live; default:
    the GPU when there is one), ``--moe-pin-budget`` (e.g. ``64GiB``, at most 2**53
    bytes, read exactly) and ``--moe-expert-cache-compression`` (``none`` or ``exponent``:
    lossless coding of bf16/fp16 experts in host memory). Malformed values are rejected by
    the parser at once.
    """
    group = parser.add_argument_group("expert cache (serve MoE experts from host memory)")
    group.add_argument(
        "--moe-expert-cache-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="GPU slots per MoE layer (between the router's top-k and the experts per layer); "
        + ("required" if size_required else "omit to keep every expert on the GPU"),
    )
    group.add_argument(
        "--moe-expert-cache-policy",
        choices=RUNTIME_POLICY_NAMES,
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
        "CUDA-graph capturable, no host sync but for an eager prefill (default: host)",
    )
    group.add_argument(
        "--moe-expert-cache-device",
        type=device_name,
        default=None,
        metavar="DEVICE",
        help="where the slots live: cuda, cuda:N or cpu (default: cuda when this machine has a GPU, "
        "else where the weights are); a GPU cache keeps every expert in pinned host memory",
    )
    group.add_argument(
        "--moe-pin-budget",
        type=_byte_size,
        default=None,
        metavar="BYTES",
        help="most host memory to pin for the experts, e.g. 64GiB (default: no limit)",
    )
    group.add_argument(
        "--moe-expert-cache-compression",
        choices=COMPRESSION_CHOICES,
        default="none",
        help="exponent: keep bf16/fp16 experts losslessly exponent-coded in host memory (~0.68 of the "
        "bytes; the GPU decodes them on the way into the slots, so each miss moves fewer bytes); "
        "other expert dtypes are refused when the cache is built (default: none)",
    )
    return group


def cache_config_from_args(args: argparse.Namespace) -> ExpertCacheConfig | None:
    """The `ExpertCacheConfig` the flags describe, or None when ``--moe-expert-cache-size``
    was not given (the cache is off).

    The slots go where ``--moe-expert-cache-device`` says; without it, on ``"cuda"`` (the
    current GPU) when this machine has one, so a model loaded on the host is served from a
    pinned store into GPU slots, else (None) where the weights are.

    Raises:
        ValueError: a combination the flags' own parsing could not reject (device mode with
            another policy than lru), or device mode on a machine that cannot run it.
    """
    if args.moe_expert_cache_size is None:
        return None
    device = getattr(args, "moe_expert_cache_device", None)
    if device is None and torch.cuda.is_available():
        device = "cuda"
    config = ExpertCacheConfig(
        cache_size=args.moe_expert_cache_size,
        policy=args.moe_expert_cache_policy,
        budget=args.moe_expert_cache_budget,
        pin_budget_bytes=args.moe_pin_budget,
        device=None if device is None else str(device),
        mode=args.moe_expert_cache_mode,
        compression=getattr(args, "moe_expert_cache_compression", None),
    )
    check_mode_runs_here(config.mode, config.device)
    return config


def _byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> CommandLineParser:
    parser = CommandLineParser(
        prog="expertcache",
        description="Serve Mixture-of-Experts weights from host memory through a GPU slot cache.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def one_line(text: str) -> str:
    """``text`` with every run of whitespace, newlines included, made one space."""
    return " ".join(text.split())


def describe_error(error: BaseException) -> str:
    """One line saying what went wrong: ``file: reason`` for an OSError, else the message."""
    if isinstance(error, OSError) and error.strerror:
        where = f"{error.filename}: " if error.filename else ""
        return one_line(f"{where}{error.strerror}")
    return one_line(str(error)) or type(error).__name__


def out_of_memory(error: BaseException, command: str) -> str:
    """One line for running out of GPU memory: torch's first sentence (how much it tried to
    allocate) and, for ``generate``, which flags ask for less."""
    said = one_line(str(error))
    tried = said.split(" GPU ")[0] if "Tried to allocate" in said else said
    less = (
        "a smaller --moe-expert-cache-size, a shorter prompt or fewer --max-new-tokens"
        if command == "generate"
        else "fewer --new-tokens"
    )
    return f"out of GPU memory ({tried.rstrip('.') or 'no details'}); free memory on the GPU or ask for less: {less}"


def main(argv: list[str] | None = None) -> int:
    """Run ``expertcache`` with ``argv`` (default: the process's arguments).

    Returns:
        The exit status: 0 done, 1 the command's check failed (tokens differ), 2 bad input,
        a missing optional package or a GPU out of memory (one line on stderr), 130 interrupted, 141 the reader
        of the output went away (nothing said).
    """
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # checking a flag can take a moment (a --device asks CUDA)
        print("expertcache: interrupted", file=sys.stderr)
        return 130
    try:
        with warnings.catch_warnings():  # a warning is one line too, naming the command
            warnings.showwarning = _one_line_warning(args.command)
            status = int(args.func(args))
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit
        return status
    except BrokenPipeError:  # before OSError: not bad input, the reader (``| head``) is done
        _silence_stdout()
        return STATUS_PIPE_CLOSED
    except EXPECTED_ERRORS as error:
        print(f"expertcache {args.command}: error: {describe_error(error)}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as error:  # a RuntimeError, but the GPU's size, not a bug
        print(f"expertcache {args.command}: error: {out_of_memory(error, args.command)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        extra = OPTIONAL_PACKAGES.get(error.name or "")  # the package itself, not a module it lacks
        if extra is None:
            raise
        print(
            f"expertcache {args.command}: error: needs the {extra!r} package, which is not installed: "
            f"pip install 'expertcache[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"expertcache {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line_warning(command: str):
    """A `warnings.showwarning` that prints ``expertcache <command>: warning: <message>`` (not
    Python's two lines of file, line number and source)."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"expertcache {command}: warning: {message}", file=sys.stderr if file is None else file)

    return show


def _silence_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush of what is still
    buffered fails no more (it would print a second error)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout without a descriptor (captured): nothing to flush
        pass


if __name__ == "__main__":
    sys.exit(main())
