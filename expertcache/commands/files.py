"""The files a command reads and writes: named, checked before any work, written whole.

A command checks every output path before it reads a trace or loads a model
(`check_output_path`), refuses an output that names one of its inputs or another output
(`check_distinct`), renders what it writes in memory and writes the files at the end, each
to a scratch file first (`expertcache.file_writes.write_files`), so a failure changes no
output and names the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from expertcache.file_writes import write_files


def named_path(text: str, what: str = "a file") -> Path:
    """``text`` as a `Path`; an empty name is refused (``Path("")`` is the current folder).

    Raises:
        ValueError: ``text`` is empty or only blanks.
    """
    if not text.strip():
        raise ValueError(f"must name {what}, got an empty string")
    return Path(text)


def check_output_path(path: str | Path, suffix: str | None = None) -> Path:
    """``path`` as a `Path` that a command can write, checked before any work.

    Args:
        path: the file to write (created, or replaced when it is a regular file).
        suffix: the suffix it must have (``".png"``), lower-case; None: any.

    Raises:
        ValueError: an empty name, another suffix, a directory, an existing path that is
            not a regular file (a device such as ``/dev/full``, a pipe) or not writable, or
            a folder that does not exist, is not a folder or is not writable (for a
            link: where it leads; a loop of links), a name that ends in a folder (``out/``,
            ``out/.``) or that the file system refuses (too long).
    """
    text = str(path)
    path = named_path(text)
    if os.path.basename(text) in ("", ".", ".."):  # Path("out/") is Path("out"): a file would take the name
        raise ValueError(f"{text}: names a folder; give a file name")
    if suffix is not None and path.suffix.lower() != suffix:
        raise ValueError(f"{path}: must name a {suffix} file (a name ending in {suffix})")
    try:
        _check_writable(path)
    except OSError as error:  # a name too long, a loop of links: what stat refuses
        raise ValueError(f"{path}: {error.strerror}") from None
    return path


def _check_writable(path: Path) -> None:
    """The checks of `check_output_path` that ask the file system; a link is checked where it
    leads (the messages name ``path``)."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    if target.is_symlink():  # realpath stops in a loop of links
        raise ValueError(f"{path}: a loop of symbolic links")
    if target.is_dir():
        raise ValueError(f"{path}: is a directory; give a file name")
    if target.exists() and not target.is_file():
        raise ValueError(f"{path}: not a regular file (a device, a pipe or a socket); give a file name")
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{path}: the file is not writable")
    folder = target.parent
    if not folder.exists():
        raise ValueError(f"{path}: the folder {folder} does not exist")
    if not folder.is_dir():
        raise ValueError(f"{path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: the folder {folder} is not writable")


def check_distinct(outputs: Mapping[str, Path], inputs: Mapping[str, Iterable[Path]]) -> None:
    """Refuse an output that is the same file as an input or as another output.

    Args:
        outputs: flag -> the file it writes (``{"--csv": Path(...)}``).
        inputs: flag -> the files it reads (a folder's files, one by one).

    Raises:
        ValueError: naming both flags and files; nothing has been written.
    """
    named = [(flag, path) for flag, paths in inputs.items() for path in paths]
    for flag, path in outputs.items():
        for other_flag, other in named:
            if _same_file(path, other):
                raise ValueError(f"{flag} {path} is the same file as {other_flag} {other}: give another file name")
        named.append((flag, path))


def _same_file(first: Path, second: Path) -> bool:
    if os.path.realpath(first) == os.path.realpath(second):  # Path.resolve raises on a loop of links
        return True
    return first.exists() and second.exists() and os.path.samefile(first, second)  # a hard link


def write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole (`expertcache.file_writes.write_files`).

    Raises:
        OSError: naming ``path`` (a full disk fails at the write, whose error has no file name);
            ``path`` is as it was.
    """
    write_files({path: data})
