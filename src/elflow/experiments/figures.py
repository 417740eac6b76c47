"""Figures shared by the experiments: a metric against another, one curve per setting."""

from __future__ import annotations

from pathlib import Path

from elflow.util.files import atomic_write


def plot_tradeoff(curves: list[dict], path, title: str, xlabel: str, ylabel: str, reference=(),
                  log_y: bool | None = None, shade_below: float | None = None):
    """Quality against diversity: one line per curve {"label", "points": [(x, y, annotation)], "dashed"},
    its points in the order given and annotated; `reference` points (label, x, y) as stars (held-out text).
    `log_y` None: a log scale when the values span more than a factor of 5. `shade_below`: the x below which
    samples are degenerate, shaded when it lies inside the plot. Written atomically; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, ax = plt.subplots(figsize=(7, 5))
    for i, c in enumerate(curves):
        xs, ys = [p[0] for p in c["points"]], [p[1] for p in c["points"]]
        ax.plot(xs, ys, marker="s" if c.get("dashed") else "o", linestyle="--" if c.get("dashed") else "-",
                color=f"C{i}", label=c["label"])
        for x, y, note in c["points"]:
            ax.annotate(note, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=f"C{i}")
    for label, x, y in reference:
        ax.scatter([x], [y], marker="*", s=120, color="black", label=label, zorder=3)
    ys = [p[1] for c in curves for p in c["points"]] + [y for _, _, y in reference]
    if log_y or (log_y is None and ys and max(ys) / max(min(ys), 1e-9) > 5):
        ax.set_yscale("log")
    x0, x1 = ax.get_xlim()
    if shade_below is not None and x0 < shade_below < x1:
        ax.axvspan(x0, shade_below, color="0.92", zorder=0, label=f"entropy < {shade_below:g} (degenerate)")
        ax.set_xlim(x0, x1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return path
