"""Hit rate against cache size, one line per policy, Belady's bound dashed (matplotlib)."""

from __future__ import annotations

from pathlib import Path

from expertcache.planner import Plan

_BOUNDS = {"belady": {"color": "black", "linestyle": "--", "linewidth": 2.0}}


def plot_plan(plan: Plan, path: str | Path, *, title: str = "") -> Path:
    """Draw the per-layer and global panels of ``plan`` and save them to ``path`` (PNG).

    Returns:
        The path written.

    Raises:
        ValueError: ``path`` does not end in ``.png``, is a directory, or is in a folder
            that does not exist (checked before anything is drawn).
    """
    path = check_png_path(path)
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
    figure.savefig(path, dpi=120, format="png")
    plt.close(figure)
    return path


def check_png_path(path: str | Path) -> Path:
    """``path`` as a `Path` that a PNG can be written to.

    Raises:
        ValueError: not ``*.png``, a directory, or its folder does not exist.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"{path}: the plot is a PNG; give a file name ending in .png")
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; give a file name ending in .png")
    if not path.parent.is_dir():
        raise ValueError(f"{path}: the folder {path.parent} does not exist")
    return path
