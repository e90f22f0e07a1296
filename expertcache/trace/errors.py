"""`TraceFileError`: a routing-trace file that cannot be read as a trace.

Every loader raises it (a `ValueError`) for anything wrong with the file itself: missing,
a directory, empty, not UTF-8, not JSON, truncated, a field of the wrong type, an index out
of range. The message starts with the file and, for JSON lines, the line: ``path:line:``.
"""

from __future__ import annotations

from pathlib import Path


class TraceFileError(ValueError):
    """A trace file is missing, malformed or inconsistent.

    Attributes:
        path: the file.
        line: 1-based line of a JSON-lines file, or None when the problem is the whole file
            (or an ``.npz`` member, named in the message).
    """

    def __init__(self, path: str | Path, message: str, *, line: int | None = None) -> None:
        self.path = Path(path)
        self.line = line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")
