"""Hit rate against cache size, one line per policy, Belady's bound dashed (matplotlib)."""

from __future__ import annotations

import io
from pathlib import Path

from expertcache.commands.files import check_output_path, write_whole
from expertcache.planner import Plan

_BOUNDS = {"belady": {"color": "black", "linestyle": "--", "linewidth": 2.0}}


def plot_plan(plan: Plan, path: str | Path, *, title: str = "") -> Path:
    """Draw the per-layer and global panels of ``plan`` and save them to ``path`` (PNG).

    Returns:
        The path written.

    Raises:
        ValueError: ``path`` cannot take a PNG (`check_png_path`; checked before anything
            is drawn). OSError: the write failed (naming ``path``).
    """
    path = check_png_path(path)
    write_whole(path, render_plan(plan, title=title))
    return path


def render_plan(plan: Plan, *, title: str = "") -> bytes:
    """The PNG of `plot_plan`, in memory."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for axis, scope, label in zip(axes, ("layer", "global"), ("a pool per layer", "one global pool"), strict=True):
        rows = [row for row in plan.rows if row.scope == scope]
        for policy in dict.fromkeys(row.policy for row in rows):
            points = sorted((row.fraction * 100, row.hit_rate * 100) for row in rows if row.policy == policy)
            x, y = zip(*points, strict=True)
            if policy == "unbounded":
                axis.axhline(y[0], color="grey", linestyle=":", label="unbounded cache")
                continue
            style = _BOUNDS.get(policy, {"marker": "o", "markersize": 3, "linewidth": 1.2})
            axis.plot(x, y, label="Belady (MIN, bound)" if policy == "belady" else policy, **style)
        axis.axvline(plan.budget_fraction * 100, color="tab:red", alpha=0.4, label="GPU budget")
        axis.set_title(label)
        axis.set_xlabel("cache size (% of experts resident)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("hit rate (%)")
    axes[1].legend(loc="lower right", fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, dpi=120, format="png")
    plt.close(figure)
    return image.getvalue()


def check_png_path(path: str | Path) -> Path:
    """``path`` as a `Path` that a PNG can be written to.

    Raises:
        ValueError: not ``*.png``, or not writable (`expertcache.commands.files.check_output_path`).
    """
    return check_output_path(path, ".png")
