"""One growth figure for docs/performance.md: each series' cost against the size of the work."""

from __future__ import annotations

from pathlib import Path

Series = dict[str, list[tuple[float, float]]]  # label: [(size, cost)], a missing point is left out


def plot_growth(path: Path, title: str, x_label: str, y_label: str, series: Series, log_y: bool = True,
                log_x: bool = True) -> None:
    """Write a PNG: one line per series, points marked, axes logarithmic unless told (x in powers of 2)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, points in series.items():
        if points:
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=label)
    if log_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=x_label, ylabel=y_label)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
