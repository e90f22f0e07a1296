"""Files are written whole: a failed write changes no target and leaves no scratch file.

The failure is the file system's own: a child process under a file-size limit
(``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored, so an oversized write fails with EFBIG as a
full disk fails with ENOSPC).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from expertcache.cli import describe_error
from expertcache.commands.files import write_whole
from expertcache.file_writes import write_files
from expertcache.manifest import Manifest, TensorEntry
from expertcache.trace.format import RoutingTrace

_LIMITED_WRITE = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    from expertcache.cli import describe_error
    from expertcache.file_writes import write_files

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    small, large = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        write_files({small: b"new small", large: b"x" * 100_000})
    except OSError as error:
        print(describe_error(error))
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="a file-size limit (RLIMIT_FSIZE) as on Linux")
def test_a_write_the_file_system_refuses_changes_neither_file(tmp_path):
    small, large = tmp_path / "a.csv", tmp_path / "b.png"
    small.write_bytes(b"old small")
    large.write_bytes(b"old large")
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED_WRITE, str(small), str(large)], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == f"{large}: File too large"
    assert small.read_bytes() == b"old small" and large.read_bytes() == b"old large"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.csv", "b.png"]  # no scratch left


def test_files_are_written_and_no_scratch_is_left(tmp_path):
    first, second = tmp_path / "first.csv", tmp_path / "second.png"
    second.write_bytes(b"old")
    write_files({first: b"1,2\n", second: b"\x89PNG new"})
    assert first.read_bytes() == b"1,2\n" and second.read_bytes() == b"\x89PNG new"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["first.csv", "second.png"]


def test_a_link_is_followed_and_stays_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "out.csv"
    target.write_bytes(b"old")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    write_whole(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert sorted(path.name for path in (tmp_path / "real").iterdir()) == ["out.csv"]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("pipe", "not a regular file (a device, a pipe or a socket); give a file name"),  # as /dev/full is
        ("folder", "a directory; give a file name"),
    ],
)
def test_a_target_that_is_not_a_regular_file_is_refused_before_any_write(kind, expected, tmp_path):
    """Refused, not replaced by a file (a pipe in the test's folder stands for any device: a
    regression must not replace the machine's /dev/null)."""
    odd = tmp_path / kind
    if kind == "pipe":
        os.mkfifo(odd)
    else:
        odd.mkdir()
    with pytest.raises(ValueError) as error:
        write_files({tmp_path / "kept.csv": b"x", odd: b"y"})
    assert describe_error(error.value) == f"{odd}: {expected}"
    assert sorted(path.name for path in tmp_path.iterdir()) == [kind]  # nothing written, the pipe kept
    assert odd.is_fifo() if kind == "pipe" else odd.is_dir()


def test_a_failed_write_through_the_cli_helper_names_the_file(tmp_path):
    """``open`` of a folder that vanished: the error names the target, not the scratch."""
    missing = tmp_path / "gone" / "out.csv"
    with pytest.raises(OSError) as error:
        write_whole(missing, b"x")
    assert describe_error(error.value) == f"{missing}: No such file or directory"


def test_a_trace_and_a_manifest_are_written_whole(tmp_path):
    """The library's own writers go through the same path: a device is refused, not replaced."""
    import numpy as np

    trace = RoutingTrace(np.array([[[0, 1]], [[2, 3]]], dtype=np.int16), np.zeros(1, dtype=np.int64), num_experts=4)
    written = trace.save(tmp_path / "t.npz")
    assert RoutingTrace.load(written).expert_ids.tolist() == trace.expert_ids.tolist()
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ValueError, match="not a regular file"):
        trace.save(tmp_path / "pipe")
    assert (tmp_path / "pipe").is_fifo()
    manifest_path = tmp_path / "m.json"
    with pytest.raises(ValueError, match="a directory"):
        Manifest.write(_any_manifest(), tmp_path)
    _any_manifest().write(manifest_path)
    assert Manifest.read(manifest_path) == _any_manifest()


def _any_manifest() -> Manifest:
    entry = TensorEntry("w13", (4, 2), "torch.float32", 32)
    return Manifest((entry,), layers=1, experts=4, expert_bytes=32, num_slots=2, pool_gpu_bytes=64,
                    host_bytes=128, pinned_host_bytes=0, full_residency_gpu_bytes=128, gpu_bytes_freed=64,
                    device="cpu")  # fmt: skip
