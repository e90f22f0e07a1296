"""Shared benchmark plumbing: environment stamp, CSV rows, tables, CUDA timing."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import triton

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def traces_dir() -> Path:
    """The real routing traces: $EXPERTCACHE_TRACES, else ../shared/traces, else .traces/ (carried)."""
    candidates = [os.environ.get("EXPERTCACHE_TRACES", ""), ROOT.parent / "shared" / "traces", ROOT / ".traces"]
    for candidate in candidates:
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    raise FileNotFoundError("no routing traces: set EXPERTCACHE_TRACES or place them in ../shared/traces")


def environment() -> dict[str, str]:
    """GPU name, versions and commit, stamped on every CSV row."""
    commit = os.environ.get("EXPERTCACHE_COMMIT", "")
    try:
        commit = (
            commit
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                check=True,
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("EXPERTCACHE_COMMIT", "unknown")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
    }


def append_csv(name: str, rows: Sequence[dict]) -> Path:
    """Append ``rows`` (stamped with `environment`) to ``benchmarks/results/<name>.csv``.

    Columns are the union over ``rows`` (and the existing header); missing cells stay empty.
    An existing file with more cells in a row than in its header is left alone: the rows go
    to a new ``<name>.unmerged-<UTC time>.csv`` beside it and a ValueError says so (a run's
    measurements are never lost to a damaged file).
    """
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.csv"
    stamp = environment()
    rows = [{**stamp, **row} for row in rows]
    fields = list(dict.fromkeys(key for row in rows for key in row))
    existing: list[dict] = []
    if path.exists():
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            existing = list(reader)
            fields = list(dict.fromkeys([*(reader.fieldnames or []), *fields]))
        damaged = [number for number, row in enumerate(existing, start=2) if None in row]
        if damaged:
            now = datetime.datetime.now(datetime.timezone.utc)
            aside = path.with_name(f"{name}.unmerged-{now:%Y%m%dT%H%M%S%f}.csv")
            _write_csv(aside, list(dict.fromkeys(key for row in rows for key in row)), rows)
            raise ValueError(
                f"{path}: line {damaged[0]} has more cells than the header; this run's rows went to {aside}"
            )
    _write_csv(path, fields, [*existing, *rows])
    return path


def _write_csv(path: Path, fields: list[str], rows: Sequence[dict]) -> None:
    with path.open("w", newline="") as handle:  # "\n" line ends: a run that rewrites the file changes only its rows
        writer = csv.DictWriter(handle, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def print_table(rows: Sequence[dict], columns: Sequence[str], title: str = "") -> None:
    """Print ``rows`` as a fixed-width table (floats to 3 significant digits)."""

    def cell(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    if title:
        print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(cell(row.get(c, "")).rjust(w) for c, w in zip(columns, widths, strict=True)))


def cuda_time_ms(run: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of ``run()`` over ``repeats`` calls, timed with CUDA events."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def pinned_copy_gbps(nbytes: int, repeats: int = 10) -> float:
    """Measured host -> GPU bandwidth (GB/s) of one pinned copy-engine transfer of ``nbytes``."""
    source = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = cuda_time_ms(lambda: target.copy_(source, non_blocking=True), repeats)
    return nbytes / ms / 1e6
