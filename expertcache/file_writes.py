"""Writing files whole: a reader finds the old file or the new one, never a part of one.

Each file is written to a scratch file beside it (same folder, so the rename stays on one
file system) and renamed over its target once every file of the call is written. A full
disk or a refused write leaves the targets as they were and no scratch file behind. A
symbolic link is followed: the file it leads to is replaced, the link stays.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def write_files(files: Mapping[Path, bytes]) -> None:
    """Write each ``path: data`` of ``files``: every file to its scratch first, then the
    scratches renamed over the targets.

    Raises:
        ValueError: a target that exists and is not a regular file (a folder, a device such
            as ``/dev/full``, a pipe), before anything is written.
        OSError: the first write the file system refused, naming its file (a full disk's
            error carries no file name of its own). No target has changed.
    """
    targets = {path: _regular_target(path) for path in files}
    scratches: dict[Path, Path] = {}
    try:
        for path, data in files.items():
            target = targets[path]
            # created like any file (umask), unlike mkstemp's 0600
            scratch = scratches[target] = target.with_name(f".{target.name}.{os.getpid()}.partial")
            try:
                with open(scratch, "wb") as file:
                    file.write(data)
            except OSError as error:
                raise OSError(error.errno, error.strerror, str(path)) from None
        for target, scratch in scratches.items():
            os.replace(scratch, target)
    finally:
        for scratch in scratches.values():
            scratch.unlink(missing_ok=True)  # renamed ones are gone already


def _regular_target(path: Path) -> Path:
    """The file that writing ``path`` replaces: where a link leads, and a regular file or none."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        kind = "a directory" if target.is_dir() else "not a regular file (a device, a pipe or a socket)"
        raise ValueError(f"{path}: {kind}; give a file name")
    return target
