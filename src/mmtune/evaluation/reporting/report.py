"""Markdown report with tables and plots for one evaluation's result files.

``write_report(results, out_dir, sections=...)`` writes ``report.md`` and PNGs beside it,
and the same report as ``report.html``: one static page with the plots inside it (PNG
data URLs), for a browser or the viewer's link; no server, no network.
Each result's section comes from the benchmark that produced it (its
``report_section``: MMDU per-dimension bars and Overall by turn index, synthetic exact
match by turn index, MM-Vet per-capability bars, MDI accuracy by level / scenario / age);
this module knows no benchmark by name.
"""

from __future__ import annotations

import base64
import html
import math
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from mmtune.evaluation.results import BenchmarkResult
from mmtune.io.nofollow import write_output_text

__all__ = ["write_report", "markdown_table", "metrics_section", "markdown_to_html", "write_html"]


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
    write_output_text(path, "\n".join(parts) + "\n")
    write_html(path)
    return path, plots


_CSS = """
body { font: 14px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #1c2430; padding: 0 1em; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border: 1px solid #c8ced8; padding: 3px 8px; text-align: right; font-variant-numeric: tabular-nums; }
th:first-child, td:first-child { text-align: left; }
th { background: #f0f2f6; }
img { max-width: 100%; border: 1px solid #d8dce3; margin: 4px 0; }
code { background: #f3f4f6; padding: 0 3px; }
.pos { color: #1e8449; } .neg { color: #c0392b; }
"""


def _inline(text: str) -> str:
    """One line of our Markdown (``code``, **bold**, _italic_, [links](href)) as escaped HTML."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)
    out = re.sub(r"(?<![\w])_([^_]+)_(?![\w])", r"<i>\1</i>", out)
    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", lambda m: f'<a href="{html.escape(m.group(2))}">{m.group(1)}</a>', out)


def _image(alt: str, src: str, folder: Path) -> str:
    """An image of the report inside the page (a PNG data URL), or a link when it is not a PNG beside it."""
    path = folder / src
    if path.suffix.lower() == ".png" and path.is_file() and "/" not in src:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></p>'
    return f'<p><a href="{html.escape(src)}">{html.escape(alt)}</a></p>'


def markdown_to_html(text: str, folder: Path, *, title: str = "Report") -> str:
    """A report's Markdown as one standalone HTML page.

    Knows what the reports write, nothing more: ``#``-headings, pipe tables, ``- `` lists,
    paragraphs, ``![plot](x.png)`` (embedded from ``folder``) and inline code, bold,
    italics and links; everything else is escaped text.
    """
    lines = text.splitlines()
    body: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        heading = re.match(r"(#{1,4}) (.*)", line)
        image = re.fullmatch(r"!\[([^\]]*)\]\(([^)]+)\)", line.strip())
        if heading:
            level = len(heading.group(1))
            body.append(f"<h{level}>{_inline(heading.group(2))}</h{level}>")
        elif image:
            body.append(_image(image.group(1), image.group(2), folder))
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            cells = [r for r in rows if not all(re.fullmatch(r"-+", c) for c in r)]
            head, rest = cells[0], cells[1:]
            body.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rest)
                        + "</table>")
            continue
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{_inline(lines[i][2:])}</li>")
                i += 1
            body.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif line.strip():
            body.append(f"<p>{_inline(line)}</p>")
        i += 1
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_html(markdown_path: str | Path) -> Path:
    """Write ``report.html`` beside ``markdown_path`` (``report.md``), its plots inside it."""
    path = Path(markdown_path)
    text = path.read_text(encoding="utf-8")
    first = next((line[2:] for line in text.splitlines() if line.startswith("# ")), "Report")
    target = path.with_suffix(".html")
    write_output_text(target, markdown_to_html(text, path.parent, title=first))
    return target
