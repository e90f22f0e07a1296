"""Where a measurement ran: device name, library versions and the repository commit.

Every benchmark row carries these beside its numbers.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parents[1]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPOSITORY, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPOSITORY,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("-dirty" if dirty else "")


def environment(device: torch.device) -> dict[str, str]:
    """``{"date", "device", "torch", "triton", "transformers", "commit"}``."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name or platform.machine(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "commit": _commit(),
    }
