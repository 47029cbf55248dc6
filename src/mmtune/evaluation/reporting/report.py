"""Markdown report with tables and plots for one evaluation's result files.

``write_report(results, out_dir, sections=...)`` writes ``report.md`` and PNGs beside it.
Each result's section comes from the benchmark that produced it (its
``report_section``: MMDU per-dimension bars and Overall by turn index, synthetic exact
match by turn index, MM-Vet per-capability bars, MDI accuracy by level / scenario / age);
this module knows no benchmark by name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from mmtune.evaluation.results import BenchmarkResult

__all__ = ["write_report", "markdown_table", "metrics_section"]


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.1f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def metrics_section(result: BenchmarkResult) -> list[str]:
    """Every metric of ``result`` in one two-column table: the section of a result no
    benchmark describes (an lmms-eval task, a result read back from a file)."""
    return [markdown_table(["metric", "value"], [[k, v] for k, v in result.metrics.items()])]


def write_report(results: Sequence[BenchmarkResult], out_dir: str | Path, *, title: str = "Evaluation report",
                 sections: Optional[Mapping[str, Any]] = None) -> tuple[Path, list[Path]]:
    """Write ``report.md`` (+ PNG plots) for ``results``; return its path and the plots.

    Args:
        sections: result name -> the object that writes its section, anything with
            ``report_section(result, out_dir) -> (markdown lines, plots)`` (the benchmark
            that produced it; the runner and ``mmtune evaluate report`` pass them). A result
            without one gets :func:`metrics_section`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots: list[Path] = []
    parts = [f"# {title}", ""]
    if results:
        parts += [f"Run `{results[0].run}`, model `{results[0].model}`.", ""]
    for result in results:
        ctx = f" (context {result.context_length})" if result.context_length else ""
        parts += [f"## {result.benchmark}{ctx}", ""]
        writer = (sections or {}).get(result.benchmark)
        lines, section_plots = writer.report_section(result, out) if writer is not None else (metrics_section(result), [])
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
