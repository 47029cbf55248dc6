"""Your own runs in ``mmtune report``: training curves, scores before and after, links to the viewers.

A run is a training output folder under ``--results``: it holds ``metrics.jsonl`` (one
row per logged optimizer step) or ``final/mmtune_run.json``. Its evaluations are the
result JSONs in ``<run>/eval/<name>/``: ``before`` and ``after`` from
``training.eval_before`` / ``eval_after``, and any folder the printed evaluate command
of ``mmtune train`` (or you) wrote there. For each run the report shows the loss and
learning-rate curves, one table per benchmark with every metric (the headline ones
first, then each facet: turn, capability, level, dimension) before, after and the
change, and a link to each evaluation's ``viewer.html`` and ``report.html``.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from mmtune.io.nofollow import save_figure

__all__ = ["RunSummary", "find_runs", "runs_markdown", "runs_html", "plot_runs"]


@dataclass
class RunSummary:
    """One training run as the report shows it."""

    path: Path
    name: str
    family: Optional[str] = None
    final_step: Optional[int] = None
    steps: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    evaluations: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``{evaluation folder name: {benchmark: result record}}``, ``before`` first."""
    curves: Optional[Path] = None
    """The PNG of the loss and learning-rate curves (:func:`plot_runs`)."""

    def columns(self) -> list[str]:
        """Evaluation names in the order of the table: ``before``, ``after``, then the others."""
        order = {"before": 0, "after": 1}
        return sorted(self.evaluations, key=lambda tag: (order.get(tag, 2), tag))


def _number(value: Any) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _read_metrics(path: Path) -> tuple[list[float], list[float], list[float]]:
    """Steps, loss and learning rate of a ``metrics.jsonl`` (rows without them skipped; a
    line torn by a crash is ignored)."""
    steps, loss, lr = [], [], []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        step, value = _number(row.get("step")), _number(row.get("train/loss"))
        if step is None or value is None:
            continue
        steps.append(step)
        loss.append(value)
        lr.append(_number(row.get("train/lr")) or 0.0)
    return steps, loss, lr


def _is_run(folder: Path) -> bool:
    return (folder / "metrics.jsonl").is_file() or (folder / "final" / "mmtune_run.json").is_file()


def find_runs(paths: Iterable[str | os.PathLike], records: Sequence[Any]) -> list[RunSummary]:
    """The training runs under ``paths`` (folders, searched recursively), each with the
    result ``records`` (:class:`~mmtune.evaluation.reporting.tables.ResultRecord`) of its
    ``eval/<name>/`` folders."""
    folders: dict[Path, None] = {}
    for root in map(Path, paths):
        if not root.is_dir():
            continue
        candidates = [root, *(p.parent for p in root.rglob("metrics.jsonl")),
                      *(p.parent.parent for p in root.rglob("final/mmtune_run.json"))]
        for folder in candidates:
            if _is_run(folder) and "eval" not in folder.relative_to(root).parts:
                folders[folder.resolve()] = None
    runs = []
    for folder in sorted(folders):
        run = RunSummary(folder, folder.name)
        if (folder / "metrics.jsonl").is_file():
            run.steps, run.loss, run.lr = _read_metrics(folder / "metrics.jsonl")
        meta_file = folder / "final" / "mmtune_run.json"
        if meta_file.is_file():
            try:
                meta = json.loads(meta_file.read_text(encoding="utf-8"))
                run.name = str(meta.get("run") or run.name)
                run.family, run.final_step = meta.get("family"), meta.get("step")
            except (OSError, json.JSONDecodeError):
                pass
        for record in records:
            where = Path(record.path).resolve().parent
            if where.parent.name == "eval" and where.parent.parent == folder:
                run.evaluations.setdefault(where.name, {})[record.benchmark] = record
        runs.append(run)
    return runs


def plot_runs(runs: Sequence[RunSummary], out_dir: Path) -> None:
    """Write each run's loss and learning-rate curves as one PNG into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for index, run in enumerate(runs):
        if not run.steps:
            continue
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.0))
        left.plot(run.steps, run.loss, linewidth=1.2)
        if len(run.loss) > 1 and min(run.loss) > 0 and max(run.loss) / min(run.loss) > 20:
            left.set_yscale("log")  # a loss falling by orders of magnitude
        left.set_title("training loss (per loss token)")
        right.plot(run.steps, run.lr, linewidth=1.2, color="tab:orange")
        right.set_title("learning rate")
        for ax in (left, right):
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
        fig.suptitle(run.name, fontsize=10)
        fig.tight_layout()
        run.curves = out_dir / f"run{index + 1}_{_slug(run.name)}_curves.png"
        save_figure(fig, run.curves, dpi=100)
        plt.close(fig)


def _slug(name: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60] or "run"


def _rows(run: RunSummary, benchmark: str) -> list[tuple[str, list[Optional[float]], Optional[float]]]:
    """(metric, a value per evaluation, after - before) for one benchmark of a run: the
    headline metrics first, then the facets, each in the order the result lists it."""
    tags = run.columns()
    present = [run.evaluations[t].get(benchmark) for t in tags]
    names: dict[str, None] = {}
    for record in present:
        if record is not None:
            names.update(dict.fromkeys(record.metrics))
    ordered = [m for m in names if "/" not in m] + [m for m in names if "/" in m]
    rows = []
    for metric in ordered:
        values = [r.metrics.get(metric) if r is not None else None for r in present]
        before = values[tags.index("before")] if "before" in tags else None
        later = next((v for t, v in zip(tags, values) if t != "before" and v is not None), None)
        rows.append((metric, values, later - before if later is not None and before is not None else None))
    return rows


def _fmt(value: Optional[float], signed: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _link(target: Path, out_dir: Path) -> str:
    return Path(os.path.relpath(target.resolve(), out_dir.resolve())).as_posix()


def _describe(run: RunSummary) -> str:
    parts = [f"folder `{run.path}`"]
    if run.family:
        parts.append(f"family {run.family}")
    if run.final_step is not None:
        parts.append(f"final/ at step {run.final_step}")
    if run.loss:
        parts.append(f"loss {run.loss[0]:.3g} at step {run.steps[0]:g} -> {run.loss[-1]:.3g} at step {run.steps[-1]:g}")
    return ", ".join(parts)


def runs_markdown(runs: Sequence[RunSummary], out_dir: Path) -> list[str]:
    """The "Your runs" section of ``report.md``."""
    if not runs:
        return []
    lines = ["## Your runs", ""]
    for run in runs:
        lines += [f"### {run.name}", "", _describe(run) + ".", ""]
        if run.curves is not None:
            lines += [f"![{run.name} curves]({run.curves.name})", ""]
        tags = run.columns()
        for benchmark in sorted({b for evals in run.evaluations.values() for b in evals}):
            lines.append("| " + " | ".join([f"{benchmark} metric", *tags, "change"]) + " |")
            lines.append("|" + "---|" * (len(tags) + 2))
            for metric, values, delta in _rows(run, benchmark):
                lines.append("| " + " | ".join([metric, *map(_fmt, values), _fmt(delta, signed=True)]) + " |")
            lines.append("")
        links = []
        for tag in tags:
            folder = run.path / "eval" / tag
            for page in ("viewer.html", "report.html"):
                if (folder / page).is_file():
                    links.append(f"[{tag}: {page}]({_link(folder / page, out_dir)})")
        if links:
            lines += ["Answers and reports: " + ", ".join(links), ""]
        if not run.evaluations:
            lines += ["No evaluation in its eval/ folder yet: the end of `mmtune train` prints the command.", ""]
    return lines


def runs_html(runs: Sequence[RunSummary], out_dir: Path) -> list[str]:
    """The "Your runs" section of ``report.html``: the curves inside the page (PNG data
    URLs), the tables, links to each evaluation's viewer and report."""
    if not runs:
        return []
    e = html.escape
    out = ["<h2>Your runs</h2>"]
    for run in runs:
        out.append(f"<h3 class='run'>{e(run.name)}</h3><p>{e(_describe(run).replace('`', ''))}.</p>")
        if run.curves is not None and run.curves.is_file():
            data = base64.b64encode(run.curves.read_bytes()).decode("ascii")
            out.append(f"<img class='curves' alt='{e(run.name)} loss and learning rate' "
                       f"src='data:image/png;base64,{data}' style='max-width:100%'>")
        tags = run.columns()
        for benchmark in sorted({b for evals in run.evaluations.values() for b in evals}):
            out.append(f"<table class='scores' data-benchmark='{e(benchmark)}'><tr><th>{e(benchmark)}</th>"
                       + "".join(f"<th>{e(t)}</th>" for t in tags) + "<th>change</th></tr>")
            for metric, values, delta in _rows(run, benchmark):
                cls = "pos" if delta and delta > 0 else "neg" if delta and delta < 0 else ""
                out.append(f"<tr><td>{e(metric)}</td>" + "".join(f"<td>{_fmt(v)}</td>" for v in values)
                           + f"<td class='delta {cls}'>{_fmt(delta, signed=True)}</td></tr>")
            out.append("</table>")
        links = []
        for tag in tags:
            folder = run.path / "eval" / tag
            for page in ("viewer.html", "report.html"):
                if (folder / page).is_file():
                    links.append(f"<a class='viewer' href='{e(_link(folder / page, out_dir))}'>{e(tag)}: {page}</a>")
        if links:
            out.append("<p>Answers and reports: " + ", ".join(links) + "</p>")
        if not run.evaluations:
            out.append("<p>No evaluation in its eval/ folder yet: the end of <code>mmtune train</code> prints the "
                       "command.</p>")
    return out
