"""The report's plots: grouped bars and a line over turns, written as PNGs.

Benchmarks draw their own plots for ``report.md`` with these (in
:meth:`~mmtune.evaluation.benchmarks.base.Benchmark.report_section`); matplotlib runs
headless (the Agg backend), as training nodes have no display.
"""

from __future__ import annotations

from pathlib import Path

from mmtune.io.nofollow import save_figure

__all__ = ["plot_bars", "plot_line", "plot_curves"]


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
    save_figure(fig, path, dpi=110)
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
    if len(xs) <= 20:  # one tick per turn; a lone turn otherwise gets fractional ticks around it
        ax.set_xticks(xs)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylim is not None:
        pad = 0.04 * (ylim[1] - ylim[0])
        ax.set_ylim(ylim[0] - pad, ylim[1] + pad)
    ax.set_xlabel("turn (question/answer exchange)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def plot_curves(path: Path, title: str, steps: list[float], series: dict[str, list[float]], ylabel: str, *,
                log_y: bool = False) -> Path:
    """Training curves: one line per series over optimizer steps (``log_y`` for a loss that
    falls by orders of magnitude). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.0))
    for label, ys in series.items():
        ax.plot(steps[: len(ys)], ys, label=label, linewidth=1.2)
    if log_y and all(v > 0 for ys in series.values() for v in ys):
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path
