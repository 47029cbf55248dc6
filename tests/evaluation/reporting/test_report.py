from mmtune.evaluation.benchmarks.mmdu import DIMENSIONS
from mmtune.evaluation.benchmarks.registry import benchmarks_for
from mmtune.evaluation.reporting.report import write_report
from mmtune.evaluation.results import BenchmarkResult


def test_report_tables_and_plots(tmp_path):
    mmdu = BenchmarkResult("r", "m", "mmdu", {**{d: 30.0 for d in DIMENSIONS}, **{f"valid/{d}": 40.0 for d in DIMENSIONS}},
                           {"turns": 4}, {"per_turn_index": {"0": {"Overall": 50.0, "n": 2}, "1": {"Overall": 10.0, "n": 2}}})
    mdi = BenchmarkResult("r", "m", "mdi", {"score_final": 50.0, "level1": 60.0, "level2": 40.0, "accuracy": 50.0,
                                            "scenario/sport": 50.0, "age/old": 25.0, "scenario/sport/level1": 10.0})
    mmvet = BenchmarkResult("r", "m", "mmvet", {"rec": 30.0, "ocr": 20.0, "total": 25.0, "total_std": 0.5, "int/ocr": 20.0})
    path, plots = write_report([mmdu, mdi, mmvet], tmp_path, sections=benchmarks_for(["mmdu", "mdi", "mmvet"]))
    text = path.read_text()
    assert "| all | 30.0 | 30.0" in text and "| valid | 40.0" in text
    assert "| 1 | 2 | 10.0 |" in text  # Overall by turn index
    assert "| scenario/sport | 50.0 |" in text and "| age/old | 25.0 |" in text
    assert "scenario/sport/level1" not in text  # per-level scenario splits stay in the JSON, not the summary table
    assert "| 30.0 | 20.0 | 25.0 | 0.5 |" in text
    assert {p.name for p in plots} == {"mmdu_dimensions.png", "mmdu_by_turn.png", "mdi_groups.png", "mmvet_capabilities.png"}
    assert all(p.stat().st_size > 1000 and f"]({p.name})" in text for p in plots)


def test_a_result_without_a_section_writer_gets_its_metrics_table(tmp_path):
    task = BenchmarkResult("r", "m", "ai2d", {"score": 71.5, "exact_match": 0.715}, {"n": 10})
    text = write_report([task], tmp_path)[0].read_text()
    assert "## ai2d" in text and "| score | 71.5 |" in text and "| exact_match | 0.7 |" in text and "Counts: n=10" in text
