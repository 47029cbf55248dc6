"""A new benchmark is one module and one YAML.

``toy_benchmark.py`` and ``configs/eval/toy.yaml`` (both beside this file) are the whole
toy benchmark. Once the module is imported, every part of mmtune that asks the benchmark
registry knows it: the typed ``eval.toy`` section and Hydra composition, the runner,
``report.md``, ``viewer.html``, ``mmtune plan`` and ``mmtune evaluate``; nothing under
``src/`` or ``configs/`` names it.
"""

import json
import re
from pathlib import Path

import pytest

import tests.evaluation.toy_benchmark as toy
from mmtune.data.synthetic import generate_synthetic
from mmtune.evaluation.config import EvalConfig, to_evaluate_config
from mmtune.evaluation.runner import run_benchmarks

ROOT = Path(__file__).resolve().parents[2]
SEARCHPATH = f"hydra.searchpath=[file://{toy.CONFIGS}]"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate_synthetic(tmp_path_factory.mktemp("toy"), n_train=0, n_test=4, n_llava=0, image_size=56,
                              min_images=1, max_images=2, max_turns=3)


def _exchanges(test_json):
    """[(dialogue id, turn, reference)] of an MMDU-schema file."""
    out = []
    for record in json.loads(Path(test_json).read_text()):
        answers = [m["value"] for m in record["conversations"] if m["from"] == "assistant"]
        out += [(record["id"], t, answer) for t, answer in enumerate(answers)]
    return out


@pytest.fixture(scope="module")
def predictions(data, tmp_path_factory):
    """A generation file whose first answer of each dialogue holds the reference in capitals."""
    path = tmp_path_factory.mktemp("pred") / "answers.jsonl"
    rows = [{"dialogue_id": d, "turn": t, "answer": f"It is {ref.upper()}." if t == 0 else "?"}
            for d, t, ref in _exchanges(data.test_json)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_nothing_in_mmtune_names_the_toy_benchmark():
    named = [str(p) for folder in ("src", "configs") for p in (ROOT / folder).rglob("*")
             if p.is_file() and p.suffix in (".py", ".yaml", ".md") and re.search(r"\btoy\b", p.read_text())]
    assert named == []


def test_its_section_is_typed_and_composes_like_a_built_in(data):
    from mmtune.compose import compose_config

    overrides = ["eval=toy", SEARCHPATH, f"eval.toy.data_path={data.test_json}", "eval.toy.case_sensitive=true"]
    cfg = to_evaluate_config(compose_config(overrides, config_name="evaluate"))
    assert cfg.eval.benchmarks == ["toy"] and cfg.eval.generation.max_new_tokens == 6
    assert isinstance(cfg.eval.toy, toy.ToyConfig) and cfg.eval.toy.case_sensitive is True
    assert isinstance(EvalConfig().toy, toy.ToyConfig)
    with pytest.raises(ValueError, match=r"eval\.toy\.case_sensitiv \(did you mean eval\.toy\.case_sensitive\?\)"):
        to_evaluate_config(compose_config(["eval=toy", SEARCHPATH, "+eval.toy.case_sensitiv=true"], config_name="evaluate"))


@pytest.mark.parametrize("case_sensitive", [False, True])
def test_the_runner_scores_it_and_writes_its_report_section_and_viewer_tab(data, predictions, tmp_path, case_sensitive):
    cfg = EvalConfig(benchmarks=["toy"], progress=False)
    cfg.toy.data_path, cfg.toy.image_root, cfg.toy.predictions = data.test_json, data.image_dir, str(predictions)
    cfg.toy.case_sensitive = case_sensitive
    out = tmp_path / "eval"
    result = run_benchmarks(cfg, output_dir=str(out), run_name="r", model_label="m")["toy"]
    exchanges = _exchanges(data.test_json)
    dialogues = {d for d, _, _ in exchanges}
    # the first answer holds the reference in capitals: a hit unless case matters (synthetic references are lower-case)
    hits = 0 if case_sensitive else len(dialogues)
    assert result.counts == {"turns": len(exchanges), "dialogues": len(dialogues), "hits": hits}
    assert result.metrics["contains"] == pytest.approx(100.0 * hits / len(exchanges))
    assert json.loads((out / "toy.json").read_text())["metrics"]["contains"] == result.metrics["contains"]
    report = (out / "report.md").read_text()
    assert "## toy" in report and f"| contains | {result.metrics['contains']:.1f} |" in report
    page = (out / "viewer.html").read_text()
    block = json.loads(re.search(r'<script id="viewer-data" type="application/json">(.*?)</script>', page, re.S).group(1))
    (tab,) = block["benchmarks"]
    assert tab["name"] == "toy" and tab["scale"] == toy.ToyBenchmark.viewer_scale
    assert sorted(e["id"] for e in tab["entries"]) == sorted(dialogues)
    for entry in tab["entries"]:
        statuses = [turn["status"] for turn in entry["turns"]]
        assert statuses == (["miss"] * len(statuses) if case_sensitive else ["hit"] + ["miss"] * (len(statuses) - 1))
        assert entry["score"] == pytest.approx(100.0 * statuses.count("hit") / len(statuses))
        assert entry["facets"]["images"] >= 1 and entry["turns"][0]["images"]


def test_the_runner_generates_its_answers_with_a_model(data, tmp_path):
    from mmtune.evaluation.generation.generator import DialogueGenerator
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    adapter = build_adapter(ModelConfig(family="llava"))
    model = adapter.load_model(seed=0)
    cfg = EvalConfig(benchmarks=["toy"], progress=False)
    cfg.toy.data_path, cfg.toy.image_root = data.test_json, data.image_dir
    cfg.generation.max_new_tokens = 3
    out = tmp_path / "eval"
    result = run_benchmarks(cfg, output_dir=str(out), run_name="r", model_label="m",
                            make_generator=lambda: DialogueGenerator(adapter, model, cfg.generation))["toy"]
    generated = [json.loads(line) for line in (out / "generations" / "toy.jsonl").read_text().splitlines()]
    assert len(generated) == result.counts["turns"] == len(_exchanges(data.test_json))
    assert all(r["new_tokens"] <= 3 for r in generated) and result.meta["generation"]["max_new_tokens"] == 3


def test_mmtune_plan_counts_its_work(data):
    from mmtune.training.plan import plan_evaluation

    plan = plan_evaluation(["eval=toy", SEARCHPATH, f"eval.toy.data_path={data.test_json}",
                            f"eval.toy.image_root={data.image_dir}"], gpu="h100")
    (entry,) = plan.benchmarks
    exchanges = _exchanges(data.test_json)
    images = sum(len(r["image"]) for r in json.loads(Path(data.test_json).read_text()))
    assert entry["name"] == "toy" and entry["items"] == len({d for d, _, _ in exchanges})
    assert (entry["answers"], entry["judge_calls"], entry["images"]) == (len(exchanges), 0, images)
    assert "benchmark   toy" in plan.render() and plan.generation[0]["answer_tokens"] == 6


def test_mmtune_evaluate_has_its_commands_with_its_flags_and_defaults(data, predictions, tmp_path, capsys):
    from mmtune.evaluation.cli import build_parser, config_from_args, main

    assert main(["score", "toy", "--data", data.test_json, "--predictions", str(predictions), "--out", str(tmp_path),
                 "--case-sensitive", "--quiet"]) == 0
    assert json.loads((tmp_path / "toy.json").read_text())["counts"]["hits"] == 0
    assert "toy: {'contains': 0.0}" in capsys.readouterr().out
    cfg = config_from_args(build_parser().parse_args(["checkpoint", "ckpt", "toy", "--out", "o"]))
    assert cfg.generation.max_new_tokens == 6 and cfg.toy.case_sensitive is False
