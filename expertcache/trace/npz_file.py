"""Reading the arrays of an ``.npz`` file without trusting it.

``np.load`` allocates what an array header claims before it reads a byte of data, and
turns a truncated or non-zip file into EOFError, BadZipFile, KeyError or a "pickled data"
message. Here every member is read whole (so its CRC is checked), the header's shape must
account for exactly the bytes the member holds, object arrays are refused, and no member
may claim more bytes than deflate could expand this file to: memory is bounded by the size
of the file, never by a number written inside it. Every problem is a `TraceFileError`.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

from expertcache.trace.errors import TraceFileError

#: Deflate expands at most ~1032x; a member larger than this many times the file is a lie.
_EXPANSION_LIMIT = 1100
_SLACK_BYTES = 1 << 20

#: What a corrupt zip member can raise while it is inflated and its CRC checked.
_CORRUPT = (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError, RuntimeError, struct.error)


def check_readable_file(path: Path) -> int:
    """The size of ``path`` in bytes, after checking it is an existing, non-empty file.

    Raises:
        TraceFileError: missing, a directory, or empty.
    """
    if not path.exists():
        raise TraceFileError(path, "no such file")
    if path.is_dir():
        raise TraceFileError(path, "is a directory, not a trace file")
    size = path.stat().st_size
    if size == 0:
        raise TraceFileError(path, "empty file")
    return size


def read_npz(path: Path, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The members ``names`` (without ``.npy``) of the ``.npz`` archive at ``path``.

    Returns:
        ``{name: array}``; other members are not read.

    Raises:
        TraceFileError: not a zip archive, a member missing, truncated, corrupt, an object
            (pickled) array, or a header that does not match the member's bytes.
    """
    size = check_readable_file(path)
    with open(path, "rb") as file:
        head = file.read(4)
    if not head.startswith(b"PK"):
        raise TraceFileError(path, f"not an .npz archive (a zip of .npy arrays); it starts with {head!r}")
    limit = _EXPANSION_LIMIT * size + _SLACK_BYTES
    try:
        with zipfile.ZipFile(path) as archive:
            present = set(archive.namelist())
            missing = [name for name in names if f"{name}.npy" not in present]
            if missing:
                raise TraceFileError(path, f"not a routing trace: no member {', '.join(missing)}")
            return {name: _read_member(path, archive, name, limit) for name in names}
    except _CORRUPT as error:
        raise TraceFileError(path, f"truncated or corrupt archive ({type(error).__name__}: {error})") from None


def _read_member(path: Path, archive: zipfile.ZipFile, name: str, limit: int) -> np.ndarray:
    info = archive.getinfo(f"{name}.npy")
    if info.file_size > limit:
        raise TraceFileError(path, f"member {name!r} claims {info.file_size} bytes, more than this file can hold")
    with archive.open(info) as stream:
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise TraceFileError(path, f"member {name!r} inflates to more than {limit} bytes")
    return parse_npy(path, name, data)


def parse_npy(path: Path, name: str, data: bytes) -> np.ndarray:
    """The array in the ``.npy`` bytes ``data`` (member ``name`` of ``path``).

    Raises:
        TraceFileError: a bad header, an object dtype, or a shape that does not match the
            number of data bytes.
    """
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (ValueError, SyntaxError, TypeError, OverflowError) as error:
        raise TraceFileError(path, f"member {name!r} has no valid .npy header ({error})") from None
    if dtype.hasobject:
        raise TraceFileError(path, f"member {name!r} holds pickled Python objects, which a trace never contains")
    if dtype.itemsize == 0:
        raise TraceFileError(path, f"member {name!r} has a zero-size dtype {dtype}")
    if not all(isinstance(extent, int) and extent >= 0 for extent in shape):
        raise TraceFileError(path, f"member {name!r} has an invalid shape {shape}")
    count = math.prod(shape)
    offset = stream.tell()
    if count * dtype.itemsize != len(data) - offset:
        raise TraceFileError(
            path,
            f"member {name!r} claims shape {shape} of {dtype} ({count * dtype.itemsize} bytes) "
            f"but holds {len(data) - offset} bytes",
        )
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran_order else "C").copy()  # writable, owns its memory
