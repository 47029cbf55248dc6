"""Markdown report with tables and matplotlib plots for one evaluation's result files.

``write_report(results, out_dir)`` writes ``report.md`` and PNGs beside it: MMDU
per-dimension bars (all turns vs valid turns), Overall score by turn index, synthetic
exact match by turn index, MM-Vet per-capability bars and MDI accuracy by level /
scenario / age.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

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


def _plot_line(path: Path, title: str, xs: list[int], ys: list[float], ylabel: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(xs, ys, marker="o")
    ax.set_xlabel("turn index")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(results: Sequence[BenchmarkResult], out_dir: str | Path, *, title: str = "Evaluation report") -> tuple[Path, list[Path]]:
    """Write ``report.md`` (+ PNG plots) for ``results``; return its path and the plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots: list[Path] = []
    parts = [f"# {title}", ""]
    if results:
        parts += [f"Run `{results[0].run}`, model `{results[0].model}`.", ""]
    for result in results:
        ctx = f" (context {result.context_length})" if result.context_length else ""
        parts += [f"## {result.benchmark}{ctx}", ""]
        m = result.metrics
        if result.benchmark == "mmdu":
            from mmtune.evaluation.mmdu import DIMENSIONS

            parts.append(markdown_table(["turns", *DIMENSIONS], [["all", *[m[d] for d in DIMENSIONS]],
                                                                 ["valid", *[m[f"valid/{d}"] for d in DIMENSIONS]]]))
            plots.append(_plot_bars(out / f"mmdu{ctx.strip(' ()').replace(' ', '')}_dimensions.png", "MMDU scores (x10)",
                                    {"all turns": {d: m[d] for d in DIMENSIONS},
                                     "valid turns": {d: m[f"valid/{d}"] for d in DIMENSIONS}}, "score"))
            per_turn = result.meta.get("per_turn_index", {})
            if per_turn:
                xs = sorted(int(k) for k in per_turn)
                plots.append(_plot_line(out / f"mmdu{ctx.strip(' ()').replace(' ', '')}_by_turn.png", "MMDU Overall by turn index",
                                        xs, [per_turn[str(x)]["Overall"] for x in xs], "Overall (x10)"))
                parts += ["", markdown_table(["turn", "n", "Overall"], [[x, per_turn[str(x)]["n"], per_turn[str(x)]["Overall"]] for x in xs])]
        elif result.benchmark == "synthetic":
            turns = sorted(int(k.split("/")[1]) for k in m if k.startswith("turn/"))
            parts.append(markdown_table(["metric", "value"], [["exact_match", m["exact_match"]]] + [[f"turn {t}", m[f"turn/{t}"]] for t in turns]))
            if turns:
                plots.append(_plot_line(out / "synthetic_by_turn.png", "Synthetic exact match by turn index", turns,
                                        [m[f"turn/{t}"] for t in turns], "exact match (%)"))
        elif result.benchmark == "mmvet":
            caps = [k for k in ("rec", "ocr", "know", "gen", "spat", "math") if k in m]
            parts.append(markdown_table([*caps, "total", "std"], [[*[m[c] for c in caps], m["total"], m["total_std"]]]))
            ints = sorted(k for k in m if k.startswith("int/"))
            parts += ["", markdown_table([k[4:] for k in ints], [[m[k] for k in ints]])]
            plots.append(_plot_bars(out / "mmvet_capabilities.png", "MM-Vet by capability", {"score": {c: m[c] for c in caps}}, "score"))
        elif result.benchmark == "mdi":
            keys = ["score_final", "level1", "level2", "accuracy"]
            parts.append(markdown_table(keys, [[m[k] for k in keys]]))
            groups = sorted(k for k in m if k.count("/") == 1)
            parts += ["", markdown_table(["group", "accuracy"], [[k, m[k]] for k in groups])]
            plots.append(_plot_bars(out / "mdi_groups.png", "MDI accuracy", {"accuracy": {k: m[k] for k in groups}}, "accuracy (%)"))
        else:
            parts.append(markdown_table(["metric", "value"], [[k, v] for k, v in m.items()]))
        if result.counts:
            parts += ["", "Counts: " + ", ".join(f"{k}={v}" for k, v in result.counts.items())]
        parts.append("")
    for plot in plots:
        parts.append(f"![{plot.stem}]({plot.name})")
    path = out / "report.md"
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path, plots
