"""argparse types shared by the commands: each checks one flag's value and says what is wrong.

A type raises ``argparse.ArgumentTypeError``, so a bad value ends the command at once with
argparse's exit status 2 and one line naming the flag, before any file or model is read.
`check_sequence_length` checks a token count against the model's config, before the weights.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path

from expertcache.commands.files import check_output_path, named_path

#: The largest whole number a count flag takes by default (int32: slot ids, token counts).
MAX_COUNT = 2**31 - 1

_WHOLE = re.compile(r"\s*[+-]?[0-9]+\s*")


def shown(text: str) -> str:
    """``text`` quoted for a message, cut to 40 characters."""
    return repr(text) if len(text) <= 40 else repr(text[:40]) + "..."


def whole_number(minimum: int = 1, maximum: int = MAX_COUNT) -> Callable[[str], int]:
    """An argparse type: a whole number in ``[minimum, maximum]``, read exactly (no float)."""

    def parse(text: str) -> int:
        if len(text) > 400 or not _WHOLE.fullmatch(text):
            raise argparse.ArgumentTypeError(f"must be a whole number, got {shown(text)}")
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {shown(text.strip())}")
        return value

    parse.__name__ = "whole_number"
    return parse


#: A whole number of at least 1 (a cache size, a number of tokens).
positive_int = whole_number()


def positive_number(maximum: float) -> Callable[[str], float]:
    """An argparse type: a finite number above 0 and at most ``maximum`` (``1e-6`` is fine)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {shown(text)}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {shown(text)}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:g}, got {shown(text)}")
        return value

    parse.__name__ = "positive_number"
    return parse


def output_file(suffix: str | None = None) -> Callable[[str], Path]:
    """An argparse type: a file that can be written (see `expertcache.commands.files.check_output_path`)."""

    def parse(text: str) -> Path:
        try:
            return check_output_path(text, suffix)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = "output_file"
    return parse


def input_path(text: str) -> Path:
    """An argparse type: a file or folder to read, named (an empty name would be the current folder)."""
    try:
        return named_path(text, "a file or folder")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def device_name(text: str):
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N`` that exists on this machine.

    Returns:
        The `torch.device` (``cpu:N`` is the CPU).
    """
    import torch

    from expertcache.validation import resolve_device

    try:
        device = resolve_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return torch.device("cpu") if device.type == "cpu" else device


def check_sequence_length(model_config, prompt_tokens: int, new_tokens: int, flag: str) -> None:
    """Refuse a prompt and new tokens longer together than the model's positions.

    Checked on the transformers config, before any weight is read; a config that states no
    ``max_position_embeddings`` is not limited here.

    Raises:
        ValueError: ``prompt_tokens + new_tokens`` above ``max_position_embeddings``
            (the message names ``flag``).
    """
    limit = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_tokens + new_tokens > limit:
        raise ValueError(
            f"{flag} {new_tokens}: {prompt_tokens} prompt tokens + {new_tokens} new tokens = "
            f"{prompt_tokens + new_tokens}, more than the model's max_position_embeddings ({limit})"
        )
