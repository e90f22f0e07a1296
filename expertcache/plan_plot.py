"""Hit rate against cache size, one line per policy, Belady's bound dashed (matplotlib)."""

from __future__ import annotations

from pathlib import Path

from expertcache.planner import Plan

_BOUNDS = {"belady": {"color": "black", "linestyle": "--", "linewidth": 2.0}}


def plot_plan(plan: Plan, path: str | Path, *, title: str = "") -> None:
    """Draw the per-layer and global panels of ``plan`` and save them to ``path`` (PNG)."""
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
    figure.savefig(path, dpi=120)
    plt.close(figure)
