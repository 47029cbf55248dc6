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


def test_report_html_is_the_markdown_report_as_one_page_with_its_plots_inside(tmp_path):
    from mmtune.evaluation.reporting.report import markdown_to_html
    from mmtune.evaluation.reporting.plots import plot_line

    plot_line(tmp_path / "p.png", "t", [1, 2], [1.0, 2.0], "y")
    text = "\n".join([
        "# Evaluation of <run>", "", "Run `r`, model **m** and _n_; see [viewer.html](viewer.html).", "",
        "## mmdu", "", "| metric | value |", "|---|---|", "| Overall | 1.5 |", "| a <b> | 2 |", "",
        "- first", "- second", "", "![p](p.png)", "![gone](gone.png)"])
    page = markdown_to_html(text, tmp_path, title="T")
    assert "<h1>Evaluation of &lt;run&gt;</h1>" in page and "<h2>mmdu</h2>" in page
    assert "<code>r</code>" in page and "<b>m</b>" in page and "<i>n</i>" in page
    assert '<a href="viewer.html">viewer.html</a>' in page
    assert "<tr><th>metric</th><th>value</th></tr><tr><td>Overall</td><td>1.5</td></tr>" in page
    assert "<td>a &lt;b&gt;</td>" in page and "<ul><li>first</li><li>second</li></ul>" in page
    assert 'src="data:image/png;base64,' in page and '<a href="gone.png">gone</a>' in page  # a missing plot: a link
    assert "|---|" not in page
