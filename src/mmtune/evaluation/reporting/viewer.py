"""A static results viewer: ``viewer.html`` beside an evaluation's report.

Tables say how good a model is; reading its answers says why. ``write_viewer`` renders,
for every benchmark of an evaluation, the questions and images, the model's answers and
the per-turn / per-item scores into one self-contained HTML page: no server, no network,
no JavaScript library. Open it straight from disk. Each benchmark builds its own entries
from its data file and the evaluation's ``details/*.jsonl``
(:meth:`~mmtune.evaluation.benchmarks.base.Benchmark.viewer_entries`); this module knows
no benchmark by name.

The page lists the dialogues (MMDU, synthetic) or items (MM-Vet, MDI) of one benchmark
with their scores, worst first; the list sorts by any column and filters by text and by
the benchmark's facets (MM-Vet capability, MDI level / scenario / age, MMDU scoring
dimension). Selecting an entry shows every turn: image thumbnails, the question, the
model's answer, the reference and the judge's scores and reply. The URL fragment holds the
selection (``viewer.html#b=synthetic&d=syn-test-000003``), so a view can be linked.

Images are embedded as JPEG thumbnails of at most :data:`THUMBNAIL_PX` pixels a side, up
to :data:`EMBED_BUDGET_BYTES` in total; past that budget (or with ``embed_images=False``)
the page refers to the image files by a path relative to the output folder, which works
as long as the images stay where they were. ``report.md`` (and ``report.html``) get a link
to the page; the page links ``report.html``.

The page is written after the scores, so nothing about one image may fail it: an image
above ``model.image_limits`` (checked from its header, never decoded), a decompression
bomb or a file PIL cannot decode is shown as a placeholder with its reason.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mmtune.io.nofollow import write_output_text

__all__ = ["THUMBNAIL_PX", "EMBED_BUDGET_BYTES", "ViewerEntry", "ViewerSection", "read_jsonl", "finite_mean",
           "write_viewer"]

log = logging.getLogger(__name__)

THUMBNAIL_PX = 160
"""Longest side of an embedded thumbnail, in pixels."""
EMBED_BUDGET_BYTES = 24 * 1024 * 1024
"""Total size of embedded thumbnails; later images are referenced by relative path instead."""


@dataclass
class ViewerEntry:
    """One row of the viewer's list: a dialogue (MMDU, synthetic) or an item (MM-Vet, MDI)."""

    id: str
    score: Optional[float]
    """The entry's headline score on the benchmark's scale (``None`` when unscored)."""
    turns: list[dict[str, Any]]
    """Each: ``question``, ``images`` (image keys), ``answer``, ``reference``, ``scores``, ``status``, ``rationale``."""
    facets: dict[str, Any] = field(default_factory=dict)
    """Filterable labels (capability, level, scenario, age) and per-dimension scores."""


@dataclass
class ViewerSection:
    """One benchmark's tab: its entries and what their scores mean."""

    entries: list[ViewerEntry]
    scale: str = ""
    """How to read an entry's score (``% correct``, ``x10, Overall``), shown under the page."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (``[]`` when it does not exist).

    Raises:
        ValueError: naming the file and line that is not JSON.
    """
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}); the viewer cannot read it") from None
    return rows


def finite_mean(values: list[Optional[float]]) -> Optional[float]:
    """The mean of the finite values, or ``None`` when there is none."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


class _Images:
    """Image keys -> data: URIs of thumbnails, or paths relative to the output folder; and
    why an image has neither (``problems``)."""

    def __init__(self, out: Path, *, embed: bool, budget: int, limits: Any = None):
        from mmtune.core.images import ImageLimits

        self.out, self.embed, self.budget = out, embed, budget
        self.limits = limits or ImageLimits()
        self.sources: dict[str, str] = {}
        self.problems: dict[str, str] = {}
        self.embedded = 0
        self.linked = 0
        self.missing = 0

    def add(self, path: str) -> str:
        if path in self.sources:
            return path
        source = ""
        if not os.path.exists(path):
            self.missing += 1
        elif not self._refused(path):  # a refused image is neither embedded nor linked (a browser decodes it whole)
            if self.embed and self.budget > 0:
                source = self._thumbnail(path)
            if not source and path not in self.problems:
                source = Path(os.path.relpath(os.path.abspath(path), self.out.resolve())).as_posix()
                self.linked += 1
        self.sources[path] = source
        return path

    def _refused(self, path: str) -> bool:
        """Whether the header of ``path`` states a size above the limits (the reason goes to ``problems``)."""
        from mmtune.core.images import ImageTooLargeError

        try:
            self.limits.check_file(path)
        except ImageTooLargeError as err:
            self.problems[path] = f"not shown: {err.reason}"
            return True
        except Exception:  # not an image PIL can open: the thumbnail says why
            return False
        return False

    def _thumbnail(self, path: str) -> str:
        try:
            from PIL import Image

            with Image.open(path) as img:
                img = img.convert("RGB")
                img.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
                buffer = io.BytesIO()
                img.save(buffer, format="JPEG", quality=80)
        except Exception as err:  # PIL raises many types (truncated files, SyntaxError ...): none may fail the page
            self.problems[path] = f"not shown: {type(err).__name__}: {err}"
            log.debug("viewer: no thumbnail for %s (%s)", path, err)
            return ""
        data = buffer.getvalue()
        if len(data) > self.budget:
            self.budget = 0
            return ""
        self.budget -= len(data)
        self.embedded += 1
        return "data:image/jpeg;base64," + base64.b64encode(data).decode("ascii")


def _summary(out: Path, name: str) -> dict[str, Any]:
    path = out / f"{name}.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    metrics = {k: v for k, v in (data.get("metrics") or {}).items() if "/" not in k or k.startswith("valid/Overall")}
    return {"metrics": metrics, "counts": data.get("counts") or {}}


def _baseline_entries(section: Optional[ViewerSection]) -> dict[str, Any]:
    """``{entry id: {score, turns: [{answer, scores, status}]}}`` of the other evaluation."""
    if section is None:
        return {}
    return {e.id: {"score": e.score, "facets": {k: v for k, v in e.facets.items() if k.startswith("dim:")},
                   "turns": [{"answer": t.get("answer"), "scores": t.get("scores") or {}, "status": t.get("status", "")}
                             for t in e.turns]}
            for e in section.entries}


def write_viewer(
    sections: dict[str, ViewerSection],
    output_dir: str | os.PathLike,
    *,
    title: str = "Evaluation answers",
    embed_images: bool = True,
    embed_budget_bytes: int = EMBED_BUDGET_BYTES,
    image_limits: Any = None,
    baseline: Optional[dict[str, ViewerSection]] = None,
    baseline_label: str = "before training",
    baseline_dir: Optional[str | os.PathLike] = None,
) -> Optional[Path]:
    """Write ``output_dir/viewer.html`` with one tab per benchmark of ``sections``.

    Args:
        sections: benchmark name -> its entries (each benchmark builds its own, see
            :meth:`~mmtune.evaluation.benchmarks.base.Benchmark.viewer_entries`;
            :func:`mmtune.evaluation.runner.collect_entries` asks them).
        title: the page title.
        embed_images: embed JPEG thumbnails (<= :data:`THUMBNAIL_PX` px a side) until
            ``embed_budget_bytes`` is spent; otherwise link the image files relatively.
        image_limits: largest images a thumbnail is made of (``model.image_limits``;
            default: the defaults); a larger one is a placeholder with the reason.
        baseline: the same benchmarks evaluated on the model this one started from (the
            run's ``eval/before``): each entry then shows both answers side by side, the
            list both scores and the change.
        baseline_label: what the baseline is, as the page names it.
        baseline_dir: its folder (for its summary and a link to its own viewer).

    Returns:
        The page's path, or ``None`` when ``sections`` is empty.
    """
    out = Path(output_dir)
    if not sections:
        return None
    images = _Images(out, embed=embed_images, budget=embed_budget_bytes, limits=image_limits)
    benchmarks = []
    for name, section in sections.items():
        rows = section.entries
        for entry in rows:
            for turn in entry.turns:
                turn["images"] = [images.add(p) for p in turn["images"]]
        facet_keys = sorted({k for e in rows for k in e.facets if not k.startswith("dim:") and k != "images"})
        before = _baseline_entries((baseline or {}).get(name))
        benchmarks.append({
            "name": name,
            "scale": section.scale,
            "summary": _summary(out, name),
            "baseline": before,
            "baseline_summary": _summary(Path(baseline_dir), name) if before and baseline_dir else {},
            "facets": facet_keys,
            "dimensions": sorted({k[4:] for e in rows for k in e.facets if k.startswith("dim:")}),
            "entries": [{"id": e.id, "score": e.score, "facets": e.facets, "turns": e.turns} for e in rows],
        })
    plots = sorted(p.name for p in out.glob("*.png"))
    other = Path(baseline_dir) / "viewer.html" if baseline_dir else None
    payload = {
        "title": title,
        "baseline_label": baseline_label,
        "baseline_viewer": (Path(os.path.relpath(other.resolve(), out.resolve())).as_posix()
                            if other is not None and other.is_file() else None),
        "benchmarks": benchmarks,
        "images": images.sources,
        "image_problems": images.problems,
        "plots": plots,
        "report": next((name for name in ("report.html", "report.md") if (out / name).is_file()), None),
        "note": (f"{images.embedded} image(s) embedded as thumbnails of at most {THUMBNAIL_PX} px a side; "
                 f"{images.linked} linked by relative path; {images.missing} not found"
                 + (f"; {len(images.problems)} not shown (see each one's reason)." if images.problems else ".")),
    }
    path = out / "viewer.html"
    tmp = path.with_suffix(".html.tmp")
    write_output_text(tmp, _render(payload))
    os.replace(tmp, path)
    _link_from_report(out / "report.md")
    return path


_REPORT_LINK = "Every answer, with images and scores: [viewer.html](viewer.html) (open it in a browser)."


def _link_from_report(report: Path) -> None:
    """Add a link to the viewer under the report's title (once)."""
    if not report.is_file():
        return
    lines = report.read_text(encoding="utf-8").splitlines()
    if _REPORT_LINK in lines:
        return
    at = 2 if lines and lines[0].startswith("# ") else 0
    lines[at:at] = [_REPORT_LINK, ""]
    write_output_text(report, "\n".join(lines) + "\n")
    from mmtune.evaluation.reporting.report import write_html

    write_html(report)  # report.html carries the link too


def _render(payload: dict[str, Any]) -> str:
    # "</script>" or "<!--" in an answer would end or derail the <script> block: "<" only
    # occurs inside JSON strings, where \u003c means the same character.
    data = json.dumps(payload, ensure_ascii=False, allow_nan=False, default=str).replace("<", "\\u003c")
    return _PAGE.replace("__TITLE__", html.escape(payload["title"])).replace("__DATA__", data)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
:root { --bad: #c0392b; --ok: #1e8449; --mid: #b9770e; --line: #d8dce3; --muted: #5d6778; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1c2430; background: #f5f6f8; }
header { padding: 10px 16px; background: #1f2a3a; color: #fff; display: flex; gap: 16px; align-items: baseline; flex-wrap: wrap; }
header h1 { font-size: 17px; margin: 0; }
header a { color: #9cc7ff; }
nav { display: flex; gap: 4px; padding: 8px 16px 0; border-bottom: 1px solid var(--line); background: #fff; }
nav button { border: 1px solid var(--line); border-bottom: none; background: #eef1f5; padding: 6px 12px; cursor: pointer; border-radius: 6px 6px 0 0; font: inherit; }
nav button.active { background: #fff; font-weight: 600; }
#summary { padding: 8px 16px; background: #fff; border-bottom: 1px solid var(--line); color: var(--muted); }
#summary b { color: #1c2430; }
main { display: grid; grid-template-columns: minmax(320px, 38%) 1fr; gap: 12px; padding: 12px 16px; }
.panel { background: #fff; border: 1px solid var(--line); border-radius: 8px; overflow: hidden; }
.controls { display: flex; gap: 6px; padding: 8px; border-bottom: 1px solid var(--line); flex-wrap: wrap; }
.controls input, .controls select { font: inherit; padding: 3px 6px; }
.controls input { flex: 1; min-width: 120px; }
#list-wrap { max-height: calc(100vh - 190px); overflow: auto; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 4px 8px; border-bottom: 1px solid #eef0f3; text-align: left; }
th { position: sticky; top: 0; background: #f0f2f6; cursor: pointer; user-select: none; white-space: nowrap; }
th.sorted::after { content: " \\25B2"; font-size: 10px; }
th.sorted.desc::after { content: " \\25BC"; }
tr.item { cursor: pointer; }
tr.item:hover { background: #f3f7ff; }
tr.item.selected { background: #dde9ff; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.score-bad { color: var(--bad); font-weight: 600; } .score-mid { color: var(--mid); } .score-ok { color: var(--ok); }
#detail { padding: 12px 16px; max-height: calc(100vh - 150px); overflow: auto; }
#detail h2 { margin: 0 0 8px; font-size: 16px; }
.turn { border: 1px solid var(--line); border-radius: 8px; padding: 8px 10px; margin-bottom: 10px; }
.turn-head { display: flex; justify-content: space-between; color: var(--muted); font-size: 12px; margin-bottom: 4px; }
.thumbs { display: flex; gap: 6px; flex-wrap: wrap; margin: 4px 0; }
.thumbs figure { margin: 0; text-align: center; font-size: 11px; color: var(--muted); }
.thumbs img { max-width: 160px; max-height: 160px; border: 1px solid var(--line); border-radius: 4px; display: block; }
.label { font-size: 11px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); }
.text { white-space: pre-wrap; margin: 0 0 6px; }
.answer { background: #f7f9fc; border-left: 3px solid #7a9cc6; padding: 4px 8px; }
.reference { background: #f6fbf6; border-left: 3px solid #7ab07f; padding: 4px 8px; }
.status-wrong .answer, .status-missing .answer { border-left-color: var(--bad); }
.scores { display: flex; gap: 6px; flex-wrap: wrap; margin: 4px 0; }
.chip { border: 1px solid var(--line); border-radius: 10px; padding: 0 8px; font-size: 12px; background: #fafbfc; }
details.rationale pre { white-space: pre-wrap; font-size: 12px; background: #fafafa; padding: 6px; }
#plots { display: flex; gap: 8px; flex-wrap: wrap; padding: 8px 16px 16px; }
#plots img { max-height: 220px; border: 1px solid var(--line); background: #fff; }
footer { color: var(--muted); font-size: 12px; padding: 0 16px 16px; }
.empty { color: var(--muted); padding: 12px; }
.compare { display: grid; grid-template-columns: 1fr 1fr; gap: 8px; }
.compare .side { min-width: 0; }
.before .answer { border-left-color: #9aa3b2; background: #f4f5f7; }
.delta-pos { color: var(--ok); font-weight: 600; } .delta-neg { color: var(--bad); font-weight: 600; }
</style></head>
<body>
<header><h1 id="title"></h1><span id="report-link"></span></header>
<nav id="tabs"></nav>
<div id="summary"></div>
<main>
  <section class="panel">
    <div class="controls">
      <input id="filter" type="search" placeholder="filter by id, question, answer...">
      <select id="facet"></select>
      <select id="dimension"></select>
    </div>
    <div id="list-wrap"><table><thead id="list-head"></thead><tbody id="list"></tbody></table></div>
  </section>
  <section class="panel" id="detail"><div class="empty">Select a dialogue or item on the left.</div></section>
</main>
<div id="plots"></div>
<footer id="note"></footer>
<script id="viewer-data" type="application/json">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("viewer-data").textContent);
const state = { bench: 0, selected: null, sortKey: "score", sortDesc: false, filter: "", facet: "", dimension: "" };
const $ = (id) => document.getElementById(id);
const el = (tag, attrs, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k.startsWith("on")) node.addEventListener(k.slice(2), v); else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
};
const fmt = (v) => (v === null || v === undefined || Number.isNaN(v)) ? "n/a" : (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(1)) : String(v));
const bench = () => DATA.benchmarks[state.bench];
function scoreOf(e) {
  if (state.dimension) return e.facets["dim:" + state.dimension];
  return e.score;
}
// the same entry evaluated on the model this run started from (eval/before), if any
const baselineOf = (e) => (bench().baseline || {})[e.id];
const hasBaseline = () => Object.keys(bench().baseline || {}).length > 0;
function beforeScoreOf(e) {
  const b = baselineOf(e);
  if (!b) return null;
  return state.dimension ? (b.facets || {})["dim:" + state.dimension] : b.score;
}
function deltaOf(e) {
  const a = scoreOf(e), b = beforeScoreOf(e);
  return (a === null || a === undefined || b === null || b === undefined) ? null : a - b;
}
function scoreClass(v) {
  if (v === null || v === undefined) return "";
  return v < 34 ? "score-bad" : (v < 67 ? "score-mid" : "score-ok");
}
function facetValues(e) {
  const out = [];
  for (const k of bench().facets) {
    const v = e.facets[k];
    if (Array.isArray(v)) for (const x of v) out.push(k + "=" + x); else if (v !== undefined && v !== null) out.push(k + "=" + v);
  }
  return out;
}
function visibleEntries() {
  const text = state.filter.toLowerCase();
  let rows = bench().entries.filter((e) => {
    if (state.facet && !facetValues(e).includes(state.facet)) return false;
    if (!text) return true;
    if (e.id.toLowerCase().includes(text)) return true;
    return e.turns.some((t) => [t.question, t.answer, t.reference].some((s) => s && String(s).toLowerCase().includes(text)));
  });
  const key = state.sortKey, sign = state.sortDesc ? -1 : 1;
  const value = (e) => key === "score" ? scoreOf(e) : key === "before" ? beforeScoreOf(e) : key === "delta" ? deltaOf(e)
    : key === "id" ? e.id : key === "turns" ? e.turns.length : e.facets[key];
  rows = rows.slice().sort((a, b) => {
    const x = value(a), y = value(b);
    if (x === y) return a.id < b.id ? -1 : 1;
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * sign;
  });
  return rows;
}
function renderTabs() {
  const tabs = $("tabs"); tabs.replaceChildren();
  DATA.benchmarks.forEach((b, i) => tabs.append(el("button", { class: i === state.bench ? "active" : "", "data-bench": b.name,
    onclick: () => { selectBench(i); updateHash(); } }, `${b.name} (${b.entries.length})`)));
}
function renderSummary() {
  const s = bench().summary || {}, parts = [];
  for (const [k, v] of Object.entries(s.metrics || {})) parts.push(el("span", {}, k + " ", el("b", {}, fmt(v))), "  ");
  for (const [k, v] of Object.entries(s.counts || {})) parts.push(`${k}=${v}  `);
  const b = bench().baseline_summary || {};
  if (Object.keys(b.metrics || {}).length) {
    parts.push(el("span", { class: "baseline-summary" }, `  |  ${DATA.baseline_label}: `,
      ...Object.entries(b.metrics).map(([k, v]) => el("span", {}, k + " ", el("b", {}, fmt(v)), "  "))));
  }
  $("summary").replaceChildren(...parts);
}
function renderControls() {
  const facet = $("facet"); facet.replaceChildren(el("option", { value: "" }, "all " + (bench().facets.join(" / ") || "entries")));
  const seen = new Set();
  for (const e of bench().entries) for (const v of facetValues(e)) seen.add(v);
  [...seen].sort().forEach((v) => facet.append(el("option", { value: v }, v)));
  facet.value = state.facet;
  const dim = $("dimension"); dim.replaceChildren(el("option", { value: "" }, "score"));
  for (const d of bench().dimensions) dim.append(el("option", { value: d }, "score: " + d));
  dim.value = state.dimension; dim.style.display = bench().dimensions.length ? "" : "none";
}
function renderList() {
  const compare = hasBaseline() ? [["before", "before"], ["delta", "change"]] : [];
  const cols = [["id", "id"], ["score", state.dimension ? state.dimension : "score"], ...compare, ["turns", "turns"],
    ...bench().facets.map((f) => [f, f])];
  $("list-head").replaceChildren(el("tr", {}, ...cols.map(([key, label]) => el("th", {
    class: key === state.sortKey ? ("sorted" + (state.sortDesc ? " desc" : "")) : "", "data-key": key,
    onclick: () => { state.sortDesc = state.sortKey === key ? !state.sortDesc : false; state.sortKey = key; renderList(); } }, label))));
  const rows = visibleEntries();
  $("list").replaceChildren(...rows.map((e) => {
    const v = scoreOf(e);
    return el("tr", { class: "item" + (e.id === state.selected ? " selected" : ""), "data-id": e.id,
      onclick: () => { state.selected = e.id; renderList(); renderDetail(); updateHash(); } },
      el("td", {}, e.id), el("td", { class: "num " + scoreClass(v) }, fmt(v)),
      ...(hasBaseline() ? [el("td", { class: "num before-score " + scoreClass(beforeScoreOf(e)) }, fmt(beforeScoreOf(e))),
                           el("td", { class: "num delta " + deltaClass(deltaOf(e)) }, signed(deltaOf(e)))] : []),
      el("td", { class: "num" }, e.turns.length),
      ...bench().facets.map((f) => el("td", {}, Array.isArray(e.facets[f]) ? e.facets[f].join(", ") : fmt(e.facets[f]))));
  }));
  if (!rows.length) $("list").append(el("tr", {}, el("td", { colspan: cols.length, class: "empty" }, "no entry matches")));
}
const signed = (v) => (v === null || v === undefined) ? "n/a" : (v > 0 ? "+" : "") + fmt(v);
const deltaClass = (v) => (v === null || v === undefined || v === 0) ? "" : (v > 0 ? "delta-pos" : "delta-neg");
function answerBlock(label, answer) {
  return [el("div", { class: "label" }, label),
          el("p", { class: "text answer" }, answer === null || answer === undefined ? "(no answer)" : answer)];
}
function image(key, index) {
  const src = DATA.images[key];
  const name = key.split("/").pop();
  const problem = (DATA.image_problems || {})[key];
  if (!src) return el("figure", { title: problem || key }, el("div", { class: "chip" }, problem || "image not found"), name);
  return el("figure", { title: key }, el("img", { src: src, alt: name, loading: "lazy" }), `#${index} ${name}`);
}
function renderDetail() {
  const box = $("detail");
  const e = bench().entries.find((x) => x.id === state.selected);
  if (!e) { box.replaceChildren(el("div", { class: "empty" }, "Select a dialogue or item on the left.")); box.removeAttribute("data-id"); return; }
  box.setAttribute("data-id", e.id);
  let shown = 0;
  const chips = (scores) => Object.entries(scores || {}).map(([k, v]) => el("span", { class: "chip" }, `${k}: ${fmt(v)}`));
  const base = baselineOf(e);
  const turns = e.turns.map((t, i) => {
    const thumbs = t.images.map((k) => image(k, ++shown));
    const scores = chips(t.scores);
    const status = t.status || "";
    const was = base && base.turns[i];
    // with the run's eval/before: both answers side by side, each with its status and scores
    const answers = was
      ? el("div", { class: "compare" },
          el("div", { class: "side before status-" + (was.status || "").split(" ")[0] },
            ...answerBlock(`answer ${DATA.baseline_label} (${was.status || "n/a"})`, was.answer),
            was.scores && Object.keys(was.scores).length ? el("div", { class: "scores" }, ...chips(was.scores)) : null),
          el("div", { class: "side after" }, ...answerBlock(`model answer (${status || "n/a"})`, t.answer),
            scores.length ? el("div", { class: "scores" }, ...scores) : null))
      : el("div", {}, ...answerBlock("model answer", t.answer), null);
    return el("div", { class: "turn status-" + status.split(" ")[0], "data-turn": i },
      el("div", { class: "turn-head" }, el("span", {}, `turn ${i + 1}`), el("span", {}, status)),
      thumbs.length ? el("div", { class: "thumbs" }, ...thumbs) : null,
      el("div", { class: "label" }, "question"), el("p", { class: "text question" }, t.question),
      answers,
      el("div", { class: "label" }, "reference"), el("p", { class: "text reference" }, t.reference ?? ""),
      !was && scores.length ? el("div", { class: "scores" }, ...scores) : null,
      t.rationale ? el("details", { class: "rationale" }, el("summary", {}, "judge reply"), el("pre", {}, t.rationale)) : null);
  });
  const facets = Object.entries(e.facets).filter(([k]) => !k.startsWith("dim:")).map(([k, v]) => `${k}: ${Array.isArray(v) ? v.join(", ") : fmt(v)}`);
  const beforeChip = base ? [el("span", { class: "chip " + scoreClass(base.score) }, `${DATA.baseline_label}: ${fmt(base.score)}`)] : [];
  box.replaceChildren(el("h2", {}, `${bench().name} / ${e.id}`),
    el("div", { class: "scores" }, el("span", { class: "chip " + scoreClass(e.score) }, "score: " + fmt(e.score)),
      ...beforeChip, ...facets.map((f) => el("span", { class: "chip" }, f))), ...turns);
}
function selectBench(i) {
  state.bench = i; state.selected = null; state.facet = ""; state.dimension = ""; state.sortKey = "score"; state.sortDesc = false;
  renderTabs(); renderSummary(); renderControls(); renderList(); renderDetail();
}
function updateHash() {
  const params = new URLSearchParams({ b: bench().name });
  if (state.selected) params.set("d", state.selected);
  history.replaceState(null, "", "#" + params.toString());
}
function fromHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  const i = DATA.benchmarks.findIndex((b) => b.name === params.get("b"));
  selectBench(i >= 0 ? i : 0);
  if (params.get("d")) { state.selected = params.get("d"); renderList(); renderDetail(); }
}
$("title").textContent = DATA.title;
if (DATA.report) $("report-link").append(el("a", { href: DATA.report }, "report (tables and plots)"));
if (DATA.baseline_viewer) $("report-link").append("  ", el("a", { href: DATA.baseline_viewer }, `answers ${DATA.baseline_label}`));
$("filter").addEventListener("input", (ev) => { state.filter = ev.target.value; renderList(); });
$("facet").addEventListener("change", (ev) => { state.facet = ev.target.value; renderList(); });
$("dimension").addEventListener("change", (ev) => { state.dimension = ev.target.value; renderList(); });
window.addEventListener("hashchange", fromHash);
$("plots").replaceChildren(...DATA.plots.map((p) => el("a", { href: p }, el("img", { src: p, alt: p }))));
const scales = DATA.benchmarks.filter((b) => b.scale).map((b) => `${b.name} ${b.scale}`);
$("note").textContent = DATA.note + (scales.length ? " Scores: " + scales.join(", ") + "." : "") + " Entries are listed worst first.";
fromHash();
</script>
</body></html>
"""
