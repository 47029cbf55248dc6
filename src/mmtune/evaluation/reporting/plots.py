"""The report's plots: grouped bars and a line over turns, written as PNGs.

Benchmarks draw their own plots for ``report.md`` with these (in
:meth:`~mmtune.evaluation.benchmarks.base.Benchmark.report_section`); matplotlib runs
headless (the Agg backend), as training nodes have no display.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_bars", "plot_line"]


def plot_bars(path: Path, title: str, groups: dict[str, dict[str, float]], ylabel: str) -> Path:
    """Grouped bars: one group per key of the first series, one bar per series (``groups``:
    series label -> {bar name: value}); a missing value is drawn as no bar. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on training nodes
    import matplotlib.pyplot as plt

    names = list(next(iter(groups.values())).keys())
    width = 0.8 / max(1, len(groups))
    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(names) + 2), 3.5))
    for i, (label, values) in enumerate(groups.items()):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [values.get(n, float("nan")) for n in names], width=width, label=label)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(groups) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_line(path: Path, title: str, xs: list[int], ys: list[float], ylabel: str,
               ylim: tuple[float, float] | None = None) -> Path:
    """A line over turns (``xs`` numbered from 1, as reports number them); ``ylim`` fixes the value axis (a flat line at 0% or 100% is
    otherwise drawn on an axis of +-0.04)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(xs, ys, marker="o")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylim is not None:
        pad = 0.04 * (ylim[1] - ylim[0])
        ax.set_ylim(ylim[0] - pad, ylim[1] + pad)
    ax.set_xlabel("turn (question/answer exchange)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
