"""Markdown report with tables and matplotlib plots for one evaluation's result files.

``write_report(results, out_dir)`` writes ``report.md`` and PNGs beside it: MMDU
per-dimension bars (all turns vs valid turns), Overall score by turn index, synthetic
exact match by turn index, MM-Vet per-capability bars and MDI accuracy by level /
scenario / age.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.evaluation.results import BenchmarkResult

__all__ = ["write_report", "markdown_table"]


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.1f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _plot_bars(path: Path, title: str, groups: dict[str, dict[str, float]], ylabel: str) -> Path:
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


def _plot_line(path: Path, title: str, xs: list[int], ys: list[float], ylabel: str,
               ylim: tuple[float, float] | None = None) -> Path:
    """A line over turn indices; ``ylim`` fixes the value axis (a flat line at 0% or 100% is
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
    ax.set_xlabel("turn index")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(results: Sequence[BenchmarkResult], out_dir: str | Path, *, title: str = "Evaluation report",
                 sections: Optional[dict[str, Any]] = None) -> tuple[Path, list[Path]]:
    """Write ``report.md`` (+ PNG plots) for ``results``; return its path and the plots.

    Each result's section comes from its benchmark (:meth:`Benchmark.report_section`);
    ``sections`` maps a result's name to the benchmark that produced it (lmms-eval tasks
    and unknown names get a plain metric table).
    """
    from mmtune.evaluation.benchmarks.base import Benchmark
    from mmtune.evaluation.benchmarks.registry import get_benchmark

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots: list[Path] = []
    parts = [f"# {title}", ""]
    if results:
        parts += [f"Run `{results[0].run}`, model `{results[0].model}`.", ""]
    for result in results:
        ctx = f" (context {result.context_length})" if result.context_length else ""
        parts += [f"## {result.benchmark}{ctx}", ""]
        bench = (sections or {}).get(result.benchmark)
        if bench is None:
            try:
                bench = get_benchmark(result.benchmark)
            except ValueError:
                bench = Benchmark()
        lines, section_plots = bench.report_section(result, out)
        parts += lines
        plots += section_plots
        if result.counts:
            parts += ["", "Counts: " + ", ".join(f"{k}={v}" for k, v in result.counts.items())]
        stats = result.meta.get("judge_stats") or {}
        if stats.get("failed"):
            first = stats.get("first_error") or {}
            parts += ["", f"**Judge failures: {stats['failed']} of {stats.get('requests')} calls** (scored 0). "
                          f"First error: {first.get('message')}; likely cause: {first.get('cause')}"]
        parts.append("")
    for plot in plots:
        parts.append(f"![{plot.stem}]({plot.name})")
    path = out / "report.md"
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path, plots
