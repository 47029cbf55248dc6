"""``mmtune report``: your runs, and the paper's tables with our measured numbers beside them.

Collects mmtune result JSONs (one per run and benchmark, schema in
:mod:`mmtune.evaluation.results`; lmms-eval results arrive in the same schema through
the evaluator's converter) and the training runs they belong to. For each run it shows
the loss and learning-rate curves, every metric before and after training and links to
the viewers (:mod:`mmtune.evaluation.reporting.runs`); then it fills the tables defined
in :mod:`mmtune.evaluation.reporting.paper_numbers`. It writes ``report.md``,
``report.html`` (one static page, every plot inside it), ``report.json`` and the PNGs.
A cell with no result is shown as missing ("—"), never filled from another run or
estimated; without ``--tables`` or ``--sweep``, only tables with a result are shown.

Example::

    mmtune report --results outputs/mine --out outputs/mine/report
    mmtune report --results outputs/ --sweep launch/sweeps/table5_eval.yaml --out reports/table5
    mmtune report --results outputs/ --tables table2,table3 --row table3.llava15_7b=my_llava_run
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from mmtune.evaluation.reporting.paper_numbers import TABLES, Column, Row, TableSpec
from mmtune.io.nofollow import save_figure, write_output_text

__all__ = [
    "ResultRecord",
    "ResultSet",
    "Cell",
    "FilledTable",
    "collect_results",
    "add_lmms_results",
    "fill_table",
    "render_markdown",
    "render_html",
    "plot_table",
    "write_report",
    "sweep_runs",
    "main",
]

MISSING = "—"
DEFAULT_TABLES = ("table2", "table3", "table5")
"""The tables shown without ``--tables`` / ``--sweep``, when a result fills one."""
_REQUIRED_KEYS = ("run", "benchmark", "metrics")


@dataclass(frozen=True)
class ResultRecord:
    """One result JSON file (the evaluator's schema)."""

    path: Path
    run: str
    model: str
    benchmark: str
    context_length: Optional[int]
    metrics: dict[str, float]
    meta: dict[str, Any]


@dataclass
class ResultSet:
    """All result files found, plus what was ignored and why (shown in the report)."""

    records: list[ResultRecord] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    """Files that are JSON but not results (e.g. run metadata); name only."""
    problems: list[str] = field(default_factory=list)
    """Files that look like results but are malformed: path and what is wrong."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parse_result(path: Path, data: Any) -> tuple[Optional[ResultRecord], Optional[str]]:
    """Returns (record, None), (None, problem) or (None, None) for a non-result JSON."""
    if not isinstance(data, dict) or not all(k in data for k in _REQUIRED_KEYS):
        return None, None
    errors = []
    if not isinstance(data["run"], str) or not data["run"]:
        errors.append("`run` must be a non-empty string")
    if not isinstance(data["benchmark"], str) or not data["benchmark"]:
        errors.append("`benchmark` must be a non-empty string")
    if not isinstance(data["metrics"], dict):
        errors.append("`metrics` must be an object {name: number}")
    ctx = data.get("context_length")
    if ctx is not None and (not isinstance(ctx, int) or isinstance(ctx, bool) or ctx <= 0):
        errors.append(f"`context_length` must be a positive integer or null, got {ctx!r}")
    if errors:
        return None, f"{path}: " + "; ".join(errors) + " (see mmtune.evaluation.results for the schema)"
    # Non-numeric metrics (None for an unscorable metric, NaN) stay out: the cell shows missing.
    metrics = {str(k): float(v) for k, v in data["metrics"].items() if _is_number(v)}
    return (
        ResultRecord(
            path=path,
            run=data["run"],
            model=str(data.get("model") or ""),
            benchmark=data["benchmark"],
            context_length=ctx,
            metrics=metrics,
            meta=dict(data.get("meta") or {}),
        ),
        None,
    )


def add_lmms_results(results: ResultSet, run: str, path: str | os.PathLike) -> None:
    """Convert a raw lmms-eval results JSON with the evaluator's converter and add it as ``run``.

    lmms-eval's file does not say which mmtune run produced it, hence the explicit run name.
    """
    from mmtune.evaluation.benchmarks.lmms_eval import parse_results

    try:
        converted = parse_results(path, run=run, model=str(path))
    except (OSError, ValueError) as err:
        results.problems.append(f"{path}: {err}")
        return
    for r in converted:
        results.records.append(ResultRecord(path=Path(path), run=run, model=r.model, benchmark=r.benchmark,
                                            context_length=r.context_length,
                                            metrics={k: v for k, v in r.metrics.items() if _is_number(v)},
                                            meta=dict(r.meta)))


def collect_results(paths: Iterable[str | os.PathLike]) -> ResultSet:
    """Read every ``*.json`` under ``paths`` (files or directories, recursively).

    JSON files that do not carry the result keys (``run``, ``benchmark``, ``metrics``)
    are listed as ignored; result-shaped files with wrong types are listed as problems.
    A path that does not exist is a problem too (a typo must not look like "no results").
    """
    out = ResultSet()
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.rglob("*.json") if q.is_file())
        elif p.is_file():
            files.append(p)
        else:
            out.problems.append(f"{p}: no such file or directory (pass result files or folders to --results)")
    for f in files:
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            out.problems.append(f"{f}: not readable JSON ({err})")
            continue
        record, problem = _parse_result(f, data)
        if record is not None:
            out.records.append(record)
        elif problem is not None:
            out.problems.append(problem)
        else:
            out.ignored.append(str(f))
    return out


@dataclass
class Cell:
    """One table cell: the paper's number, ours, and where ours came from."""

    paper: Optional[float]
    ours: Optional[float]
    source: Optional[str] = None
    """Result file (and metric) that gave ``ours``; ``None`` when missing."""

    @property
    def delta(self) -> Optional[float]:
        if self.paper is None or self.ours is None:
            return None
        return self.ours - self.paper


@dataclass
class FilledTable:
    spec: TableSpec
    rows: list[tuple[Row, list[Cell]]]
    notes: list[str] = field(default_factory=list)
    """Which result was chosen where several matched, and similar provenance."""


def _pick(records: list[ResultRecord], row: Row, runs: tuple[str, ...], notes: list[str], table: str):
    """The results that may fill ``row``, newest file first per benchmark."""
    chosen: dict[str, ResultRecord] = {}
    candidates = [r for r in records if r.run in runs]
    if row.context_length is not None:
        candidates = [r for r in candidates if r.context_length == row.context_length]
    by_bench: dict[str, list[ResultRecord]] = {}
    for r in candidates:
        by_bench.setdefault(r.benchmark, []).append(r)
    for bench, group in by_bench.items():
        if row.context_length is None:
            # A run evaluated at several windows: the row (no window given) takes its longest.
            longest = max((r.context_length or 0) for r in group)
            if len({r.context_length for r in group}) > 1:
                notes.append(
                    f"{table} row {row.key!r}, {bench}: results at several context lengths; "
                    f"used the longest ({longest})."
                )
            group = [r for r in group if (r.context_length or 0) == longest]
        group.sort(key=lambda r: r.path.stat().st_mtime if r.path.exists() else 0.0, reverse=True)
        if len(group) > 1:
            notes.append(
                f"{table} row {row.key!r}, {bench}: {len(group)} result files; used the newest "
                f"({group[0].path}), ignored {', '.join(str(r.path) for r in group[1:])}."
            )
        chosen[bench] = group[0]
    return chosen


def _value(column: Column, chosen: dict[str, ResultRecord]) -> tuple[Optional[float], Optional[str]]:
    for bench, metric, scale in column.sources:
        rec = chosen.get(bench)
        if rec is not None and metric in rec.metrics:
            return rec.metrics[metric] * scale, f"{rec.path}:{metric}"
    return None, None


def fill_table(spec: TableSpec, results: ResultSet, row_runs: Optional[dict[str, tuple[str, ...]]] = None) -> FilledTable:
    """Fill ``spec`` from ``results``.

    Args:
        row_runs: overrides of which runs fill a row, keyed by row key.
    """
    row_runs = row_runs or {}
    filled = FilledTable(spec=spec, rows=[])
    for row in spec.rows:
        chosen = _pick(results.records, row, row_runs.get(row.key, row.runs), filled.notes, spec.key)
        for bench, rec in sorted(chosen.items()):
            if rec.meta.get("comparable_with_published") is False:
                filled.notes.append(f"{spec.key} row {row.key!r}, {bench}: not comparable with the published figure: "
                                    + "; ".join(rec.meta.get("comparability_notes") or []))
        cells: dict[str, Cell] = {}
        for column, paper in zip(spec.columns, row.paper):
            if column.mean_of:
                continue
            ours, source = _value(column, chosen)
            cells[column.key] = Cell(paper=paper, ours=ours, source=source)
        for column, paper in zip(spec.columns, row.paper):
            if column.mean_of:
                parts = [cells[k].ours for k in column.mean_of]
                ours = sum(parts) / len(parts) if all(p is not None for p in parts) else None
                cells[column.key] = Cell(paper=paper, ours=ours, source="mean" if ours is not None else None)
        filled.rows.append((row, [cells[c.key] for c in spec.columns]))
    return filled


# ----------------------------------------------------------------------------- rendering


def _fmt(value: Optional[float], signed: bool = False) -> str:
    if value is None:
        return MISSING
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def render_markdown(tables: Sequence[FilledTable], results: ResultSet, images: dict[str, str],
                    runs: Sequence[str] = ()) -> str:
    """Markdown: the runs section (``runs``, lines), then one table per spec, each cell
    ``paper / ours (Δ)``."""
    lines = [f"# {_title(tables)}", ""] + list(runs)
    if tables:
        lines += ["Each cell: paper / ours (Δ = ours − paper). " f"{MISSING} = no result (or no published number).", ""]
    for t in tables:
        lines += [f"## {t.spec.title}", ""]
        lines.append("| " + " | ".join(["Model"] + [c.label for c in t.spec.columns]) + " |")
        lines.append("|" + "---|" * (len(t.spec.columns) + 1))
        for row, cells in t.rows:
            parts = [f"{_fmt(c.paper)} / {_fmt(c.ours)} ({_fmt(c.delta, signed=True)})" for c in cells]
            lines.append("| " + " | ".join([row.label] + parts) + " |")
        lines.append("")
        if t.spec.note:
            lines += [f"_{t.spec.note}_", ""]
        if t.spec.key in images:
            lines += [f"![{t.spec.title}]({images[t.spec.key]})", ""]
        lines += [f"- {n}" for n in t.notes]
        if t.notes:
            lines.append("")
    lines += _provenance_md(results)
    return "\n".join(lines)


def _prompt_note(meta: dict[str, Any]) -> str:
    """Which judge prompt (name and hash) and judge made a result, when one did."""
    prompt = meta.get("prompt")
    if not isinstance(prompt, dict):
        return ""
    note = f", judge {meta.get('judge_model')}, prompt {prompt.get('name')} (sha256 {str(prompt.get('sha256', ''))[:12]})"
    if "comparable_with_published" in meta:
        note += ", comparable with published: " + ("yes" if meta["comparable_with_published"] else "no")
    return note


def _provenance_md(results: ResultSet) -> list[str]:
    out = ["## Result files", ""]
    out += [f"- `{r.path}`: run `{r.run}`, {r.benchmark}, context {r.context_length}{_prompt_note(r.meta)}"
            for r in results.records]
    if not results.records:
        out.append("- none found")
    if results.problems:
        out += ["", "### Problems", ""] + [f"- {p}" for p in results.problems]
    out.append("")
    return out


_CSS = """
body { font-family: sans-serif; margin: 2em; }
table { border-collapse: collapse; margin-bottom: 0.5em; }
th, td { border: 1px solid #bbb; padding: 4px 8px; text-align: center; }
th:first-child, td:first-child { text-align: left; }
.paper { color: #555; } .ours { font-weight: bold; } .missing { color: #b00; }
.pos { color: #070; } .neg { color: #b00; } .note { color: #555; font-style: italic; }
table.scores td { text-align: right; } table.scores td:first-child { text-align: left; }
"""


def _html_num(value: Optional[float], cls: str, signed: bool = False) -> str:
    if value is None:
        return f'<span class="{cls} missing">{MISSING}</span>'
    if signed:
        cls += " pos" if value > 0 else " neg" if value < 0 else ""
    return f'<span class="{cls}">{html.escape(_fmt(value, signed))}</span>'


def _viewer_link(result_path: Any) -> str:
    # The evaluation that wrote a result file leaves its answers viewer beside it.
    viewer = Path(result_path).parent / "viewer.html"
    return f" (<a href='{html.escape(viewer.resolve().as_uri())}'>answers</a>)" if viewer.is_file() else ""


def _title(tables: Sequence[FilledTable]) -> str:
    return "MMDU reproduction report" if tables else "Report of your runs"


def render_html(tables: Sequence[FilledTable], results: ResultSet, images: dict[str, str],
                runs: Sequence[str] = ()) -> str:
    """A standalone HTML page: the runs section (``runs``, HTML), then the same tables
    (paper, ours, Δ stacked per cell)."""
    e = html.escape
    title = _title(tables)
    out = ["<!DOCTYPE html>", f"<html><head><meta charset='utf-8'><title>{e(title)}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{e(title)}</h1>", *runs]
    if tables:
        out.append(f"<p>Each cell: paper / <b>ours</b> / Δ (ours − paper). {MISSING} = no result.</p>")
    for t in tables:
        out.append(f"<h2>{e(t.spec.title)}</h2><table><tr><th>Model</th>")
        out += [f"<th>{e(c.label)}</th>" for c in t.spec.columns]
        out.append("</tr>")
        for row, cells in t.rows:
            out.append(f"<tr><td>{e(row.label)}</td>")
            for c in cells:
                title = f' title="{e(c.source)}"' if c.source else ""
                out.append(
                    f"<td{title}>{_html_num(c.paper, 'paper')}<br>{_html_num(c.ours, 'ours')}"
                    f"<br>{_html_num(c.delta, 'delta', signed=True)}</td>"
                )
            out.append("</tr>")
        out.append("</table>")
        if t.spec.note:
            out.append(f"<p class='note'>{e(t.spec.note)}</p>")
        if t.notes:
            out.append("<ul>" + "".join(f"<li>{e(n)}</li>" for n in t.notes) + "</ul>")
        if t.spec.key in images:
            out.append(f"<img src='{e(images[t.spec.key])}' alt='{e(t.spec.title)}' style='max-width:100%'>")
    out.append("<h2>Result files</h2><ul>")
    out += [f"<li><code>{e(str(r.path))}</code>: run <code>{e(r.run)}</code>, {e(r.benchmark)}, "
            f"context {r.context_length}{_viewer_link(r.path)}</li>" for r in results.records] or ["<li>none found</li>"]
    out.append("</ul>")
    if results.problems:
        out.append("<h3>Problems</h3><ul>" + "".join(f"<li>{e(p)}</li>" for p in results.problems) + "</ul>")
    out.append("</body></html>")
    return "\n".join(out)


def plot_table(table: FilledTable, path: str | os.PathLike) -> Path:
    """Write a PNG: grouped bars (paper hatched, ours solid) or score vs context length.

    Missing values are not drawn; a bar plot marks them with "n/a" so an absent bar is
    never mistaken for a zero.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = table.spec
    path = Path(path)
    if spec.plot == "context":
        col = next(i for i, c in enumerate(spec.columns) if c.key == spec.plot_column)
        in_series = [(r, cells) for r, cells in table.rows if r.key in spec.series]
        others = [(r, cells) for r, cells in table.rows if r.key not in spec.series]
        fig, axes = plt.subplots(1, 2 if others else 1, figsize=(11 if others else 6.5, 4.2),
                                 gridspec_kw={"width_ratios": [2, 1]} if others else None, squeeze=False)
        ax = axes[0][0]
        names = list(dict.fromkeys(spec.series[r.key] for r, _ in in_series))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, name in enumerate(names):
            pts = sorted((r.context_length, cells[col]) for r, cells in in_series if spec.series[r.key] == name)
            xs_p = [x for x, c in pts if c.paper is not None]
            if xs_p:
                ax.plot(xs_p, [c.paper for x, c in pts if c.paper is not None], "--o", color=colors[i % 10],
                        alpha=0.6, label=f"{name} (paper)")
            xs_o = [x for x, c in pts if c.ours is not None]
            if xs_o:
                ax.plot(xs_o, [c.ours for x, c in pts if c.ours is not None], "-s", color=colors[i % 10],
                        label=f"{name} (ours)")
            for x, c in pts:
                if c.ours is None:
                    ax.annotate("ours: n/a", (x, c.paper if c.paper is not None else 0), fontsize=7,
                                textcoords="offset points", xytext=(4, -10), color=colors[i % 10])
        xs = sorted({r.context_length for r, _ in in_series})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x // 1024}k" if x % 1024 == 0 else str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("evaluation context length (tokens)")
        ax.set_ylabel(spec.columns[col].label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if others:
            _bars(axes[0][1], [r.label for r, _ in others], [[cells[col]] for _, cells in others], [""])
            axes[0][1].set_title(spec.columns[col].label, fontsize=9)
    else:
        fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(spec.columns) + 2), 4.5))
        _bars(ax, [c.label for c in spec.columns],
              [[cells[j] for j in range(len(spec.columns))] for _, cells in table.rows],
              [r.label for r, _ in table.rows], by_column=True)
    fig.suptitle(spec.title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax, groups: list[str], cells_per_series: list[list[Cell]], series: list[str], by_column: bool = False):
    """Grouped bars. ``by_column``: groups are columns, one pair of bars per row (series)."""
    import numpy as np

    colors = __import__("matplotlib.pyplot", fromlist=["x"]).rcParams["axes.prop_cycle"].by_key()["color"]
    if by_column:
        n_series, n_groups = len(series), len(groups)
        get = lambda s, g: cells_per_series[s][g]  # noqa: E731
    else:  # one series, groups are rows
        n_series, n_groups = 1, len(groups)
        get = lambda s, g: cells_per_series[g][0]  # noqa: E731
    width = 0.8 / (2 * n_series)
    x = np.arange(n_groups)
    for s in range(n_series):
        color = colors[s % 10]
        for k, kind in enumerate(("paper", "ours")):
            offs = x - 0.4 + width * (2 * s + k) + width / 2
            for g in range(n_groups):
                cell = get(s, g)
                value = cell.paper if kind == "paper" else cell.ours
                if value is None:
                    if kind == "ours":
                        ax.text(offs[g], 0.5, "n/a", rotation=90, fontsize=6, ha="center", va="bottom", color="#b00")
                    continue
                ax.bar(offs[g], value, width, color=color, alpha=0.35 if kind == "paper" else 1.0,
                       hatch="//" if kind == "paper" else None, edgecolor=color)
    from matplotlib.patches import Patch

    handles = [Patch(color=colors[s % 10], label=series[s]) for s in range(n_series) if series[s]]
    handles += [Patch(facecolor="#ccc", edgecolor="#999", hatch="//", label="paper (hatched)"),
                Patch(color="#999", label="ours (solid)")]
    ax.set_xlim(-0.6, n_groups - 0.4)
    ax.set_xticks(x, groups, rotation=30 if n_groups > 6 else 0, ha="right" if n_groups > 6 else "center", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(handles=handles, fontsize=7, ncol=min(len(handles), 6), loc="upper center",
              bbox_to_anchor=(0.5, -0.18 if n_groups > 6 else -0.1), frameon=False)


# ----------------------------------------------------------------------------- driving


def sweep_runs(sweep_file: str | os.PathLike) -> list[str]:
    """Run names of a W&B sweep file: the values of its ``experiment`` (or ``+experiment``)
    parameter; every experiment's run is named after it."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(sweep_file), resolve=False)
    params = (cfg or {}).get("parameters") or {}
    param = params.get("experiment") or params.get("+experiment")
    if not isinstance(param, dict):
        raise ValueError(f"{sweep_file}: no `parameters.experiment` grid; a sweep names the experiments it runs")
    values = param.get("values") or ([param["value"]] if "value" in param else [])
    if not values:
        raise ValueError(f"{sweep_file}: `parameters.experiment` has no `values` list")
    return [str(v) for v in values]


def write_report(
    results: ResultSet,
    table_keys: Sequence[str],
    out_dir: str | os.PathLike,
    row_runs: Optional[dict[str, dict[str, tuple[str, ...]]]] = None,
    runs: Sequence[Any] = (),
) -> dict[str, Path]:
    """Fill, plot and write the tables, after the section of ``runs``
    (:func:`~mmtune.evaluation.reporting.runs.find_runs`). Returns ``{"markdown", "html",
    "json", <table>: png}``."""
    from mmtune.evaluation.reporting.runs import plot_runs, runs_html, runs_markdown

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    row_runs = row_runs or {}
    plot_runs(runs, out)
    tables = [fill_table(TABLES[k], results, row_runs.get(k)) for k in table_keys]
    images: dict[str, str] = {}
    paths: dict[str, Path] = {}
    for t in tables:
        png = plot_table(t, out / f"{t.spec.key}.png")
        images[t.spec.key] = png.name
        paths[t.spec.key] = png
    paths["markdown"] = out / "report.md"
    write_output_text(paths["markdown"], render_markdown(tables, results, images, runs_markdown(runs, out)))
    paths["html"] = out / "report.html"
    write_output_text(paths["html"], render_html(tables, results, images, runs_html(runs, out)))
    paths["json"] = out / "report.json"
    write_output_text(paths["json"], json.dumps(_as_json(tables), indent=2))
    return paths


def _as_json(tables: Sequence[FilledTable]) -> dict[str, Any]:
    return {
        t.spec.key: {
            "title": t.spec.title,
            "columns": [c.key for c in t.spec.columns],
            "rows": {
                row.key: {c.key: {"paper": cell.paper, "ours": cell.ours, "delta": cell.delta, "source": cell.source}
                          for c, cell in zip(t.spec.columns, cells)}
                for row, cells in t.rows
            },
            "notes": t.notes,
        }
        for t in tables
    }


def _log_wandb(tables_json: dict[str, Any], paths: dict[str, Path], project: str, entity: Optional[str], name: str) -> None:
    import wandb

    run = wandb.init(project=project, entity=entity, name=name, job_type="report")
    try:
        for key, t in tables_json.items():
            columns = ["row"] + [f"{c}/{kind}" for c in t["columns"] for kind in ("paper", "ours", "delta")]
            table = wandb.Table(columns=columns)
            for row_key, cells in t["rows"].items():
                table.add_data(row_key, *[cells[c][kind] for c in t["columns"] for kind in ("paper", "ours", "delta")])
            run.log({key: table, f"{key}_plot": wandb.Image(str(paths[key]))})
    finally:
        run.finish()


def _parse_row_overrides(items: Sequence[str]) -> dict[str, dict[str, tuple[str, ...]]]:
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    errors = []
    for item in items:
        key, sep, runs = item.partition("=")
        table, dot, row = key.partition(".")
        if not sep or not dot or not runs:
            errors.append(f"--row {item!r}: expected TABLE.ROW=RUN[,RUN...], e.g. table5.baseline_2k=my_run")
            continue
        if table not in TABLES:
            errors.append(f"--row {item!r}: unknown table {table!r}; known: {', '.join(TABLES)}")
            continue
        if row not in {r.key for r in TABLES[table].rows}:
            errors.append(f"--row {item!r}: table {table} has no row {row!r}; rows: "
                          + ", ".join(r.key for r in TABLES[table].rows))
            continue
        out.setdefault(table, {})[row] = tuple(r for r in runs.split(",") if r)
    if errors:
        raise ValueError("\n".join(errors))
    return out


def _tables_for_runs(runs: Sequence[str]) -> list[str]:
    return [k for k, spec in TABLES.items() if any(set(r.runs) & set(runs) for r in spec.rows)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mmtune report",
        description="Report your runs (training curves, scores before and after, links to the viewers) and fill "
        "the MMDU paper's Tables 2, 3 and 5 with our results beside the published numbers.",
    )
    parser.add_argument("--results", nargs="+", default=["outputs"],
                        help="result JSON files or folders searched recursively (default: outputs)")
    parser.add_argument("--sweep", help="a sweep file under launch/sweeps/: only its runs are used, and its tables shown")
    parser.add_argument("--tables", help=f"comma-separated subset of {', '.join(TABLES)} "
                        "(default: the sweep's tables, else those of table2,table3,table5 a result fills)")
    parser.add_argument("--row", action="append", default=[], metavar="TABLE.ROW=RUN[,RUN]",
                        help="fill a row from differently named runs (repeatable)")
    parser.add_argument("--lmms-results", action="append", default=[], metavar="RUN=FILE",
                        help="a raw lmms-eval results JSON and the run it belongs to (repeatable); "
                        "results converted by `mmtune evaluate` need no flag")
    parser.add_argument("--out", default="reports", help="output folder (default: reports)")
    parser.add_argument("--wandb", action="store_true", help="also log the tables and plots to W&B")
    parser.add_argument("--wandb-project", default=os.environ.get("WANDB_PROJECT", "mmtune"))
    parser.add_argument("--wandb-entity", default=os.environ.get("WANDB_ENTITY"))
    args = parser.parse_args(list(argv) if argv is not None else None)

    try:
        overrides = _parse_row_overrides(args.row)
        runs = sweep_runs(args.sweep) if args.sweep else None
    except (ValueError, OSError) as err:
        print(f"mmtune report: {err}", file=sys.stderr)
        return 2
    if args.tables:
        keys = [k.strip() for k in args.tables.split(",") if k.strip()]
        unknown = [k for k in keys if k not in TABLES]
        if unknown:
            print(f"mmtune report: unknown table(s) {unknown}; known: {', '.join(TABLES)}", file=sys.stderr)
            return 2
    elif runs is not None:
        keys = _tables_for_runs(runs)
        if not keys:
            print(f"mmtune report: no table has a row for the runs of {args.sweep}: {runs}", file=sys.stderr)
            return 2
    else:
        keys = None  # the paper's tables that some result fills (below)

    results = collect_results(args.results)
    for item in args.lmms_results:
        run, sep, path = item.partition("=")
        if not sep or not run or not path:
            print(f"mmtune report: --lmms-results {item!r}: expected RUN=FILE", file=sys.stderr)
            return 2
        add_lmms_results(results, run, path)
    if runs is not None:
        results.records = [r for r in results.records if r.run in set(runs) | _override_runs(overrides)]
    if keys is None:
        keys = [k for k in DEFAULT_TABLES
                if any(c.ours is not None for _, cells in fill_table(TABLES[k], results, overrides.get(k)).rows
                       for c in cells)]
        if not keys:
            print(f"mmtune report: no result fills a table of the MMDU paper; showing your runs only "
                  f"(--tables {','.join(DEFAULT_TABLES)} shows the tables anyway)")
    from mmtune.evaluation.reporting.runs import find_runs

    found = find_runs(args.results, results.records)
    paths = write_report(results, keys, args.out, overrides, runs=found)
    print(paths["markdown"].read_text(encoding="utf-8"))
    plots = [str(paths[k]) for k in keys] + [str(r.curves) for r in found if r.curves is not None]
    print(f"\nwrote {paths['markdown']}, {paths['html']} (open it in a browser), {paths['json']}"
          + (f" and {', '.join(plots)}" if plots else ""))
    if args.wandb:
        tables_json = json.loads(paths["json"].read_text(encoding="utf-8"))
        _log_wandb(tables_json, paths, args.wandb_project, args.wandb_entity, name=f"report-{Path(args.out).name}")
    # Unreadable or malformed result files are worth a non-zero exit: a table with a hole
    # caused by a broken file should not pass silently in a pipeline.
    return 1 if results.problems else 0


def _override_runs(overrides: dict[str, dict[str, tuple[str, ...]]]) -> set[str]:
    return {run for rows in overrides.values() for runs in rows.values() for run in runs}


if __name__ == "__main__":
    sys.exit(main())
