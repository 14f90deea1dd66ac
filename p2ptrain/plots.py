"""PNG pictures of training: validation loss per round, one line per peer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_loss(
    series: Mapping[str, Sequence[tuple[int, float]]],
    path: Path,
    *,
    title: str = "validation loss",
    baseline: float | None = None,
) -> Path:
    """Write a PNG of loss against round.

    Args:
        series: one line per name (a peer): (round, loss) points, in any order.
        baseline: drawn as a dashed line (e.g. the untrained model's loss).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed: servers, CI, containers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    try:
        for name, points in sorted(series.items()):
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, label=name)
        if baseline is not None:
            ax.axhline(baseline, linestyle="--", color="grey", linewidth=1, label="initial")
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        ax.set_xlabel("round")
        # A mean cross-entropy: per byte on a byte-level corpus, per token on a prepared one, per image.
        ax.set_ylabel("validation loss (nats)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
