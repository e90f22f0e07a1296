"""What transformers prints while ``expertcache generate`` loads a checkpoint: held back until
the command knows whether it accepts the load.

``from_pretrained`` logs a multi-line load report (missing, unexpected, mismatched weights),
may warn, and draws a progress bar, all on stderr, before the command can check what was
loaded. A refused load must print one line, the command's error; so `held_load_output` holds
transformers' log records and Python's warnings during the load, and hides its progress bars:

- the load is accepted: `HeldOutput.show` prints what was held, as it would have been
  printed (transformers' own handlers and format, its verbosity as it was), before the
  command's first line: a report of unexpected weights, a deprecation, nothing is lost;
- the load is refused: the command's one line says why; when transformers raised, its error
  points at "the above report", so `HeldOutput.summary` folds the report's rows into that
  line (``key STATUS details``).

A progress bar cannot be held and replayed: it stays on where a person watches (stderr a
terminal: loading a large checkpoint takes minutes, and the bar is progress, not an error) and
is off for the load where stderr goes to a file or a pipe, whose reader gets the one line.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

#: The styling transformers' load report puts around its title and statuses (ANSI SGR codes).
_STYLING = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class HeldOutput:
    """What transformers logged (``records``) and what Python warned (``warned``) during a load."""

    records: list[logging.LogRecord] = field(default_factory=list)
    warned: list[warnings.WarningMessage] = field(default_factory=list)

    def show(self) -> None:
        """Print what was held as it would have been printed: each record through its logger's
        handlers (which apply their levels and format), each warning through
        `warnings.showwarning` (the command line's one-line warning)."""
        for record in self.records:
            logging.getLogger(record.name).handle(record)
        for held in self.warned:
            warnings.showwarning(held.message, held.category, held.filename, held.lineno, held.file, held.line)

    def summary(self, most: int = 3) -> str:
        """What transformers logged, as one line for an error: each load report's rows
        (``key STATUS details``), each other message whole; at most ``most`` of them. ``""``
        when nothing was logged."""
        parts = [part for record in self.records for part in _parts(_STYLING.sub("", record.getMessage()))]
        shown = "; ".join(parts[:most]) + (f" and {len(parts) - most} more" if len(parts) > most else "")
        return " ".join(shown.split())


@contextlib.contextmanager
def held_load_output(progress: bool = False) -> Iterator[HeldOutput]:
    """Hold transformers' log records and Python's warnings, and hide transformers' progress
    bars unless ``progress``, for the ``with`` block; everything is as it was after it
    (handlers, propagation, verbosity, bars). The `HeldOutput` yielded fills during the block."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.get_verbosity()  # sets up transformers' handler now, not inside the block
    library = logging.getLogger("transformers")
    handlers, propagate = library.handlers[:], library.propagate
    bars = transformers_logging.is_progress_bar_enabled()
    held = HeldOutput()
    library.handlers, library.propagate = [_Holder(held.records)], False
    _set_progress_bars(transformers_logging, bars and progress)
    try:
        with warnings.catch_warnings(record=True) as caught:
            held.warned = caught
            yield held
    finally:
        _set_progress_bars(transformers_logging, bars)
        library.handlers, library.propagate = handlers, propagate


class _Holder(logging.Handler):
    """A logging handler that keeps every record it is handed."""

    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _set_progress_bars(transformers_logging, enabled: bool) -> None:
    """Turn transformers' progress bars on or off, if they are not already."""
    if transformers_logging.is_progress_bar_enabled() == enabled:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # huggingface_hub's "cannot disable: the environment decides"
        (transformers_logging.enable_progress_bar if enabled else transformers_logging.disable_progress_bar)()


def _parts(message: str) -> list[str]:
    """The rows of a load report's table (``key | status | details``, less the header and the
    rule), or the message itself when it holds no table."""
    lines = message.splitlines()
    if not any(line.startswith("Key") and "|" in line for line in lines):
        return [message]
    rows = [line for line in lines if "|" in line and not line.startswith("Key") and line.strip("-+| ")]
    return [" ".join(cell.strip() for cell in row.split("|") if cell.strip()) for row in rows]
