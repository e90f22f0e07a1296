"""Output of `bench_ep`: a table on stdout and CSV rows with the hardware and versions."""

from __future__ import annotations

import csv
import datetime
import platform
import subprocess
from pathlib import Path

import torch
import triton

COLUMNS = [
    ("cache", "{fraction:.0%} ({slots}/{local_experts})", 14),
    ("pacing", "{pacing}", 6),
    ("rank", "{rank}", 4),
    ("step ms", "{step_ms_mean:.3f}", 9),
    ("p50 ms", "{step_ms_median:.3f}", 9),
    ("p90 ms", "{step_ms_p90:.3f}", 9),
    ("hit rate", "{hit_rate:.1%}", 8),
    ("miss/step", "{misses_per_step:.2f}", 9),
    ("MB copied", "{mb_copied:.1f}", 10),
    ("holds", "{holds}", 6),
]


def print_table(rows: list[dict]) -> None:
    first = rows[0]
    print(
        f"EP benchmark: {first['world_size']} ranks, {first['layers']} layers, "
        f"E={first['num_experts']} ({first['scheme']}), H={first['hidden']}, "
        f"I={first['inter']}, {first['dtype']}, {first['tokens_per_rank']} token(s)/rank/step, "
        f"{first['steps']} timed steps, expert record {first['record_bytes'] / 1e6:.2f} MB"
    )
    header = " ".join(f"{name:>{width}}" for name, _, width in COLUMNS)
    print(header)
    print("-" * len(header))
    for row in rows:
        print(" ".join(f"{fmt.format(**row):>{width}}" for _, fmt, width in COLUMNS))


def environment(device: torch.device, repo_root: Path) -> dict:
    """GPU, versions and commit, stated beside every number."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else ""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu or platform.machine(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "nccl": nccl,
        "commit": _git(repo_root, "rev-parse", "--short", "HEAD"),
        "dirty": bool(_git(repo_root, "status", "--porcelain", "--untracked-files=no")),
    }


def append_csv(path: Path, rows: list[dict], *, device: torch.device, repo_root: Path) -> None:
    meta = environment(device, repo_root)
    records = [{**meta, **row} for row in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        if new:
            writer.writeheader()
        writer.writerows(records)
    print(f"appended {len(records)} rows to {path}")


def _git(repo_root: Path, *args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args], cwd=repo_root, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip()
