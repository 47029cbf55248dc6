"""`mmtune report` on your own runs: curves from metrics.jsonl, every metric before and after, links to viewers."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mmtune.evaluation.reporting.runs import find_runs
from mmtune.evaluation.reporting.tables import collect_results, main
from mmtune.evaluation.results import BenchmarkResult, write_result

CHROMIUM = os.environ.get("MMTUNE_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _run(root: Path, name: str, before: dict, after: dict) -> Path:
    """A training run folder as mmtune leaves it: metrics.jsonl, final/mmtune_run.json, eval/before|after."""
    run = root / name
    (run / "final").mkdir(parents=True)
    rows = [{"step": s, "train/loss": 5.0 / s, "train/lr": 1e-3 * (1 - s / 40), "perf/tokens_per_s": 1.0}
            for s in range(1, 41)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 41, "train/lo')
    (run / "final" / "mmtune_run.json").write_text(json.dumps({"family": "llava", "run": name, "step": 40}))
    for tag, metrics in (("before", before), ("after", after)):
        write_result(BenchmarkResult(name, tag, "heldout", metrics, {"turns": 4}), run / "eval" / tag)
        (run / "eval" / tag / "viewer.html").write_text("<html>answers</html>")
    return run


@pytest.fixture
def runs(tmp_path):
    _run(tmp_path / "outputs", "mine", {"exact_match": 10.0, "turn/1": 20.0, "turn/2": 0.0},
         {"exact_match": 75.0, "turn/1": 100.0, "turn/2": 50.0})
    _run(tmp_path / "outputs", "other", {"exact_match": 50.0}, {"exact_match": 25.0})
    return tmp_path / "outputs"


def test_runs_are_found_with_their_evaluations_and_curves(runs):
    found = find_runs([runs], collect_results([runs]).records)
    assert [r.name for r in found] == ["mine", "other"]
    mine = found[0]
    assert mine.columns() == ["before", "after"] and mine.family == "llava" and mine.final_step == 40
    assert mine.steps == list(range(1, 41)) and mine.loss[0] == 5.0  # the torn last line is left out
    assert set(mine.evaluations["after"]) == {"heldout"}


def test_report_shows_each_run_before_after_and_change_per_benchmark_and_facet(runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["--results", str(runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no result fills a table of the MMDU paper; showing your runs only" in printed
    md = (out / "report.md").read_text()
    assert md.startswith("# Report of your runs") and "## Table" not in md  # no empty paper tables
    assert "| exact_match | 10.0 | 75.0 | +65.0 |" in md and "| turn/2 | 0.0 | 50.0 | +50.0 |" in md
    assert "| exact_match | 50.0 | 25.0 | -25.0 |" in md  # the other run got worse: said so
    assert md.index("| exact_match | 10.0") < md.index("| turn/1 |")  # headline first, then the facets
    page = (out / "report.html").read_text()
    curves = re.findall(r"<img class='curves'[^>]*src='data:image/png;base64,", page)
    assert len(curves) == 2 and (out / "run1_mine_curves.png").is_file()
    links = re.findall(r"class='viewer' href='([^']+)'", page)
    assert len(links) == 4 and all((out / link).resolve().is_file() for link in links)
    assert "../outputs/mine/eval/before/viewer.html" in links
    assert "<td class='delta pos'>+65.0</td>" in page and "<td class='delta neg'>-25.0</td>" in page
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page)  # no network
    # asked for, the paper's tables come after the runs
    assert main(["--results", str(runs), "--out", str(tmp_path / "r2"), "--tables", "table2"]) == 0
    md = (tmp_path / "r2" / "report.md").read_text()
    assert md.startswith("# MMDU reproduction report") and md.index("## Your runs") < md.index("## Table 2")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not found: `apt-get install chromium` or set MMTUNE_CHROMIUM")
def test_report_html_in_headless_chromium_draws_the_curves_and_tables(runs, tmp_path):
    out = tmp_path / "report"
    assert main(["--results", str(runs), "--out", str(out)]) == 0
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=3000", "--dump-dom", (out / "report.html").resolve().as_uri()]
    dumped = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    assert dumped.stdout.count('class="curves"') == 2 and dumped.stdout.count('class="scores"') == 2
    shot = tmp_path / "report.png"
    taken = subprocess.run([*cmd[:-2], "--window-size=1200,900", f"--screenshot={shot}",
                            (out / "report.html").resolve().as_uri()], capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as img:
        assert len(img.convert("RGB").getcolors(1 << 20)) > 50  # the curves were drawn
