"""Writing files whole: a reader finds the old file or the new one, never a part of one.

Each file is written to a scratch file beside it (same folder, so the rename stays on one
file system) and renamed over its target once every file of the call is written. A full
disk or a refused write leaves the targets as they were and no scratch file behind. A
symbolic link is followed: the file it leads to is replaced, the link stays. A file that
existed keeps its permissions; a new one gets the umask's, as any file.
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Mapping
from pathlib import Path

#: Numbers each scratch file of this process: two writes of one target (threads) never share one.
_SCRATCH_NUMBERS = itertools.count()


def write_files(files: Mapping[Path, bytes]) -> None:
    """Write each ``path: data`` of ``files``: every file to its scratch first, then the
    scratches renamed over the targets.

    Raises:
        ValueError: a target that exists and is not a regular file (a folder, a device such
            as ``/dev/full``, a pipe), a link that leads nowhere (a loop), or two paths of one
            file, before anything is written.
        OSError: the first write the file system refused, naming its file (a full disk's
            error carries no file name of its own). No target has changed.
    """
    targets = {path: _regular_target(path) for path in files}
    if len(set(targets.values())) < len(targets):
        raise ValueError(f"two of {[str(path) for path in files]} are one file (a link, or another spelling)")
    scratches: dict[Path, Path] = {}
    try:
        for path, data in files.items():
            target = targets[path]
            # created like any file (umask), unlike mkstemp's 0600; the target's name cut short,
            # so that a name near the file system's limit (255 bytes) still has a scratch
            number = next(_SCRATCH_NUMBERS)
            scratch = scratches[target] = target.with_name(f".{target.name[:32]}.{os.getpid()}.{number}.partial")
            try:
                with open(scratch, "wb") as file:
                    file.write(data)
                if target.exists():  # a file made private (0600) stays private
                    os.chmod(scratch, stat.S_IMODE(target.stat().st_mode))
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
    if target.is_symlink():  # realpath stops at a loop: replacing the link would break it
        raise ValueError(f"{path}: a symbolic link that leads to no file (a loop); give a file name")
    if target.exists() and not target.is_file():
        kind = "a directory" if target.is_dir() else "not a regular file (a device, a pipe or a socket)"
        raise ValueError(f"{path}: {kind}; give a file name")
    return target
