"""Report rendering from fixture result files: cells, deltas, missing cells, files written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmtune.evaluation.reporting import tables as report_tables
from mmtune.evaluation.reporting.paper_numbers import TABLE3, TABLE5, TABLES
from mmtune.evaluation.reporting.tables import MISSING, collect_results, fill_table, main
from tests.support.experiments import declared_recipe

REPO = Path(__file__).resolve().parents[3]


def _result(path: Path, run: str, benchmark: str, metrics: dict, context_length=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "run": run, "model": "llava-1.5-7b", "benchmark": benchmark, "context_length": context_length,
        "metrics": metrics, "counts": {"turns": 10}, "meta": {},
    }))
    return path


def _mmdu(overall: float) -> dict:
    # Distinct values per dimension so a column mix-up shows up in the assertions.
    return {"C": overall - 3, "R": overall - 2, "VP": overall - 1, "LC": overall + 10, "AA": overall + 1,
            "IRU": overall - 0.5, "Overall": overall, "valid/Overall": overall + 0.3}


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    d = tmp_path / "outputs"
    _result(d / "t5b2" / "mmdu.json", "table5_baseline_2k", "mmdu", _mmdu(21.0), 2048)
    _result(d / "t5b4" / "mmdu.json", "table5_baseline_4k", "mmdu", _mmdu(29.0), 4096)
    # The 8k-trained model evaluated at 2k and 8k; its 4k result is deliberately absent.
    _result(d / "t5m2" / "mmdu.json", "table5_mmdu45k_eval_2k", "mmdu", _mmdu(23.0), 2048)
    _result(d / "t5m8" / "mmdu.json", "table5_mmdu45k_eval_8k", "mmdu", _mmdu(36.0), 8192)
    # A result at the wrong window must not fill the 4k row.
    _result(d / "wrong" / "mmdu.json", "table5_mmdu45k_eval_4k", "mmdu", _mmdu(99.0), 2048)
    # Table 3: LLaVA baseline with MMDU, two lmms-eval tasks (one converted with its percent
    # `score`, one with only the raw fraction) and MM-Vet; nothing else.
    _result(d / "t3" / "mmdu.json", "table3_llava15_7b", "mmdu", _mmdu(31.0), 8192)
    _result(d / "t3" / "mmmu.json", "table3_llava15_7b", "mmmu_val", {"mmmu_acc": 0.351})
    _result(d / "t3" / "ai2d.json", "table3_llava15_7b", "ai2d", {"exact_match": 0.5, "score": 54.0})
    _result(d / "t3" / "mmvet.json", "table3_llava15_7b", "mmvet", {"total": 30.5, "total_std": 0.2})
    # Not a result (run metadata) and a malformed result.
    (d / "t3" / "mmtune_run.json").write_text(json.dumps({"family": "llava"}))
    (d / "bad.json").write_text(json.dumps({"run": "x", "benchmark": "mmdu", "metrics": [1, 2]}))
    return d


def test_cells_deltas_and_missing(results_dir: Path):
    results = collect_results([results_dir])
    assert len(results.records) == 9
    assert any("mmtune_run.json" in p for p in results.ignored)
    assert len(results.problems) == 1 and "bad.json" in results.problems[0] and "metrics" in results.problems[0]

    t5 = fill_table(TABLE5, results)
    rows = {row.key: {c.key: cell for c, cell in zip(TABLE5.columns, cells)} for row, cells in t5.rows}
    assert rows["baseline_2k"]["Overall"].ours == 21.0
    assert rows["baseline_2k"]["Overall"].paper == 20.9
    assert rows["baseline_2k"]["Overall"].delta == pytest.approx(0.1)
    assert rows["baseline_2k"]["LC"].ours == 31.0 and rows["baseline_2k"]["LC"].paper == 29.3
    assert rows["mmdu45k_8k"]["C"].ours == 33.0
    # Missing: no 4k result at 4096 (the 2048 one for that run must not be used), no strategy runs.
    for key in ("mmdu45k_4k", "sft_continue", "sft_pool"):
        assert all(cell.ours is None and cell.delta is None for cell in rows[key].values()), key
        assert rows[key]["Overall"].paper is not None

    t3 = fill_table(TABLE3, results)
    r3 = {row.key: {c.key: cell for c, cell in zip(TABLE3.columns, cells)} for row, cells in t3.rows}
    assert r3["llava15_7b"]["mmdu"].ours == 31.0
    assert r3["llava15_7b"]["mmmu"].ours == pytest.approx(35.1)  # raw fraction shown as percent
    assert r3["llava15_7b"]["ai2d"].ours == 54.0  # the converter's percent score wins over the raw metric
    assert r3["llava15_7b"]["mmvet"].ours == 30.5
    assert r3["llava15_7b"]["chartqa"].ours is None
    # The average needs all nine benchmarks, so it stays missing rather than averaging three.
    assert r3["llava15_7b"]["avg"].ours is None and r3["llava15_7b"]["avg"].paper == 38.9


def test_rendered_files(results_dir: Path, tmp_path: Path):
    out = tmp_path / "report"
    paths = report_tables.write_report(collect_results([results_dir]), ["table2", "table3", "table5"], out)
    md = paths["markdown"].read_text()
    line = next(l for l in md.splitlines() if l.startswith("| LLaVA1.5 @2k |"))
    assert "20.9 / 21.0 (+0.1)" in line
    line = next(l for l in md.splitlines() if l.startswith("| +MMDU-45k @4k |"))
    assert f"34.9 / {MISSING} ({MISSING})" in line and "99.0" not in line
    line = next(l for l in md.splitlines() if l.startswith("| InternLM-XC2 + MMDU-45k |"))
    assert line.count(MISSING) >= 2 * 7
    html = paths["html"].read_text()
    assert "<table>" in html and "missing" in html and "table5.png" in html
    data = json.loads(paths["json"].read_text())
    assert data["table5"]["rows"]["mmdu45k_4k"]["Overall"] == {
        "paper": 34.9, "ours": None, "delta": None, "source": None}
    for key in ("table2", "table3", "table5"):
        png = paths[key]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_with_sweep_and_row_override(results_dir: Path, tmp_path: Path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("program: recipes/evaluate.py\nparameters:\n  +experiment:\n    values: [table5_baseline_2k, table5_sft_pool_eval]\n")
    out = tmp_path / "r"
    # The malformed fixture file makes the exit code 1 (a broken file must not pass silently).
    rc = main(["--results", str(results_dir), "--sweep", str(sweep), "--out", str(out),
               "--row", "table5.sft_pool=table5_baseline_4k"])
    assert rc == 1
    data = json.loads((out / "report.json").read_text())
    assert list(data) == ["table5"]
    # Runs outside the sweep are dropped...
    assert data["table5"]["rows"]["mmdu45k_8k"]["Overall"]["ours"] is None
    # ...the sweep's run and the remapped row are filled.
    assert data["table5"]["rows"]["baseline_2k"]["Overall"]["ours"] == 21.0
    assert data["table5"]["rows"]["sft_pool"]["Overall"]["ours"] == 29.0
    assert "bad.json" in capsys.readouterr().out


def test_bad_arguments_are_explained(tmp_path: Path, capsys):
    assert main(["--results", str(tmp_path), "--row", "table9.x=y", "--out", str(tmp_path / "o")]) == 2
    assert "unknown table 'table9'" in capsys.readouterr().err
    assert main(["--results", str(tmp_path), "--tables", "table4", "--out", str(tmp_path / "o")]) == 2
    assert "unknown table" in capsys.readouterr().err


def test_missing_results_path_is_a_problem(tmp_path: Path):
    results = collect_results([tmp_path / "nope"])
    assert results.problems and "no such file" in results.problems[0]


@pytest.mark.parametrize("sweep", sorted((REPO / "launch" / "sweeps").glob("*_eval.yaml")), ids=lambda p: p.name)
def test_every_evaluation_sweep_run_has_a_table_row(sweep: Path):
    runs = report_tables.sweep_runs(sweep)
    known = {run for spec in TABLES.values() for row in spec.rows for run in row.runs}
    assert set(runs) <= known, f"{sweep.name}: runs without a report row: {set(runs) - known}"


def test_every_paper_row_is_filled_by_an_experiment():
    # Rows name the evaluation experiments whose results fill them; GPT-4o is scored from a
    # predictions file (`mmtune evaluate score`), so it has no experiment.
    for key in ("table2", "table3", "table5", "tiny_table5"):
        for row in TABLES[key].rows:
            for run in row.runs:
                if run == "gpt4o":
                    continue
                path = REPO / "configs" / "experiment" / f"{run}.yaml"
                assert path.is_file(), f"{key} row {row.key}: no experiment {run}"
                assert declared_recipe(run) == "evaluate", f"{run} is not an evaluation run"


def test_wandb_table_offline(results_dir: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    main(["--results", str(results_dir), "--tables", "table5", "--out", str(tmp_path / "r"), "--wandb",
          "--wandb-project", "mmtune-test"])
    [table_file] = list(tmp_path.glob("wandb/offline-run-*/files/media/table/table5_*.table.json"))
    logged = json.loads(table_file.read_text())
    assert logged["columns"][:4] == ["row", "C/paper", "C/ours", "C/delta"]
    row = next(r for r in logged["data"] if r[0] == "baseline_2k")
    assert row[1:4] == [19.0, 18.0, pytest.approx(-1.0)]
    missing = next(r for r in logged["data"] if r[0] == "mmdu45k_4k")
    assert missing[2] is None and missing[3] is None
    assert list(tmp_path.glob("wandb/offline-run-*/files/media/images/table5_plot_*.png"))


def test_raw_lmms_eval_results_fill_table3(tmp_path: Path):
    # A recorded lmms-eval results file (its own layout: "metric,filter" keys, fractions).
    raw = tmp_path / "lmms" / "results.json"
    raw.parent.mkdir()
    raw.write_text(json.dumps({"results": {
        "mmmu_val": {"alias": "mmmu_val", "mmmu_acc,none": 0.372, "mmmu_acc_stderr,none": "N/A"},
        "chartqa": {"relaxed_overall,none": 0.234, "relaxed_overall_stderr,none": 0.008}}}))
    out = tmp_path / "r"
    rc = main(["--results", str(tmp_path / "none"), "--lmms-results", f"table3_xc2={raw}", "--tables", "table3",
               "--out", str(out)])
    assert rc == 1  # the missing --results folder is reported as a problem
    rows = json.loads((out / "report.json").read_text())["table3"]["rows"]
    assert rows["xc2"]["mmmu"]["ours"] == pytest.approx(37.2)
    assert rows["xc2"]["chartqa"]["ours"] == pytest.approx(23.4)
    assert rows["xc2"]["chartqa"]["delta"] == pytest.approx(23.4 - 62.6)
    assert rows["xc2"]["mmdu"]["ours"] is None


def test_mmvet_prompt_and_comparability_are_marked(tmp_path: Path):
    path = tmp_path / "t3" / "mmvet.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({
        "run": "table3_llava15_7b", "model": "m", "benchmark": "mmvet", "context_length": None,
        "metrics": {"total": 30.5, "total_std": 0.2}, "counts": {},
        "meta": {"judge_model": "gpt-4o", "prompt": {"name": "builtin:mmvet_judge.txt", "sha256": "ab" * 32},
                 "comparable_with_published": False,
                 "comparability_notes": ["judge model 'gpt-4o' is not the paper's gpt-4-0613"]},
    }))
    results = collect_results([tmp_path])
    table = fill_table(TABLE3, results)
    assert any("mmvet: not comparable with the published figure: judge model 'gpt-4o'" in n for n in table.notes)
    text = report_tables.render_markdown([table], results, {})
    assert "prompt builtin:mmvet_judge.txt (sha256 abababababab), comparable with published: no" in text
