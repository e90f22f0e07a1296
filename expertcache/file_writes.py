"""Writing files whole: a reader finds the old file or the new one, never a part of one.

Each file is written to a scratch file beside it (same folder, so the rename stays on one
file system) and renamed over its target once every file of the call is written. A full
disk or a refused write leaves the targets as they were and no scratch file behind.

Several files are replaced all or none: before the renames, each target that exists (but
the last, renamed when no rename is left to fail) gets a second name beside it (a hard
link: no bytes copied, and the file never goes missing; a copy where the file system has no
hard links). When a rename fails, or anything else stops the renames (Ctrl-C's
KeyboardInterrupt between two of them), the targets already replaced get their old file back
(the kept name renamed over them) and the new ones are removed, and the exception goes on;
the kept names go once every rename succeeded. A reader may see a new file for
that moment, but after the call every target is the old file or every one the new.

A symbolic link is followed: the file it leads to is replaced, the link stays. A file that
existed keeps its permissions; a new one gets the umask's, as any file.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import stat
from collections.abc import Iterable, Mapping
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
        OSError: the first write or rename the file system refused, naming its file (a full
            disk's error carries no file name of its own). No target has changed.
        Anything else raised during the call (a KeyboardInterrupt) is raised again, the targets
        as they were, unless it came after the last rename (then every target is new).
    """
    targets = {path: _regular_target(path) for path in files}
    if len(set(targets.values())) < len(targets):
        raise ValueError(f"two of {[str(path) for path in files]} are one file (a link, or another spelling)")
    scratches: dict[Path, Path] = {}
    try:
        for path, data in files.items():
            target = targets[path]
            scratch = scratches[target] = _scratch_name(target, "partial")  # created with the umask's mode
            try:
                with open(scratch, "wb") as file:
                    file.write(data)
                if target.exists():  # a file made private (0600) stays private
                    os.chmod(scratch, stat.S_IMODE(target.stat().st_mode))
            except OSError as error:
                raise OSError(error.errno, error.strerror, str(path)) from None
        _replace_all(scratches, {target: path for path, target in targets.items()})
    finally:
        for scratch in scratches.values():
            scratch.unlink(missing_ok=True)  # renamed ones are gone already


def _replace_all(scratches: dict[Path, Path], given: dict[Path, Path]) -> None:
    """Rename each scratch over its target, all or none: the old files are kept aside until
    every rename succeeded, and put back when one fails or anything else stops the renames
    (a KeyboardInterrupt); ``given``: the name the caller gave each target, for errors."""
    kept: dict[Path, Path | None] = {}  # target: its old file's second name (None: the target is new)
    renaming: Path | None = None  # the target being renamed over: an OSError in that loop is its rename's
    try:
        for target in list(scratches)[:-1]:  # the last rename has none after it to fail
            # named before the link is made: an interrupt just after it still finds the name to remove
            old = kept[target] = _scratch_name(target, "old") if target.exists() else None
            if old is not None:
                _keep_aside(target, old)
        for renaming, scratch in scratches.items():
            os.replace(scratch, renaming)
        _drop(kept.values())
    except BaseException as error:
        _undo(kept, scratches, error, None if renaming is None else given[renaming])
        raise


def _undo(kept: dict[Path, Path | None], scratches: dict[Path, Path], error: BaseException, name: Path | None) -> None:
    """After ``error`` stopped `_replace_all`: unless every rename was done (the write is
    whole), put back the old file of each target already replaced, and drop the kept names.

    A target counts as replaced when its scratch is gone: read from the files, not from where
    the error struck, so an interrupt between a rename and the next line is undone too.

    Raises:
        OSError: for ``error``, an OSError of the rename over ``name``: the same error naming
            that file (and each old file that could not be put back, and where it is now).
    """
    replaced = [target for target, scratch in scratches.items() if not scratch.exists()]
    stranded = {} if len(replaced) == len(scratches) else _restore(kept, replaced)
    _drop(old for old in kept.values() if old not in stranded.values())
    lost = "".join(f"; {where} could not be put back, its old file is {old}" for where, old in stranded.items())
    if isinstance(error, OSError) and name is not None:
        raise OSError(error.errno, f"{error.strerror}{lost}", str(name)) from None
    if lost and hasattr(error, "add_note"):  # Python 3.11+; an interrupt's traceback says what is where
        error.add_note(lost.removeprefix("; "))


def _keep_aside(target: Path, old: Path) -> None:
    """Give ``target``'s file the second name ``old`` beside it: a hard link, else a copy."""
    try:
        os.link(target, old)
    except OSError:  # no hard links here (some network or FUSE file systems)
        try:
            shutil.copy2(target, old)
        except OSError as error:
            old.unlink(missing_ok=True)
            raise OSError(error.errno, error.strerror, str(target)) from None


def _restore(kept: dict[Path, Path | None], done: list[Path]) -> dict[Path, Path]:
    """Put the old files of the targets ``done`` back (remove those that were new), last
    first; ``{target: its old file}`` of those that could not be (their old file is kept)."""
    stranded: dict[Path, Path] = {}
    for target in reversed(done):
        old = kept[target]
        try:
            if old is None:
                target.unlink(missing_ok=True)
            else:
                os.replace(old, target)
        except OSError:
            if old is not None:
                stranded[target] = old
    return stranded


def _drop(olds: Iterable[Path | None]) -> None:
    """Remove the kept old files (restored ones are gone already); one left behind is no
    reason to report a write that happened as failed."""
    for old in olds:
        if old is not None:
            with contextlib.suppress(OSError):
                old.unlink(missing_ok=True)


def _scratch_name(target: Path, kind: str) -> Path:
    """A file name beside ``target`` that no other write of this process uses: the target's
    name cut short, so that a name near the file system's limit (255 bytes) still has one."""
    return target.with_name(f".{target.name[:32]}.{os.getpid()}.{next(_SCRATCH_NUMBERS)}.{kind}")


def _regular_target(path: Path) -> Path:
    """The file that writing ``path`` replaces: where a link leads, and a regular file or none."""
    target = Path(os.path.realpath(path))
    if target.is_symlink():  # realpath stops at a loop: replacing the link would break it
        raise ValueError(f"{path}: a symbolic link that leads to no file (a loop); give a file name")
    if target.exists() and not target.is_file():
        kind = "a directory" if target.is_dir() else "not a regular file (a device, a pipe or a socket)"
        raise ValueError(f"{path}: {kind}; give a file name")
    return target
