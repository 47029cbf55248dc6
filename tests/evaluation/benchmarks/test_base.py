"""What every benchmark answers for itself outside a run: its plan counts and its CLI defaults."""

import json

import pytest

from mmtune.data.synthetic import generate_synthetic
from mmtune.evaluation.benchmarks.registry import get_benchmark, registered_names
from mmtune.evaluation.config import EvalConfig


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate_synthetic(tmp_path_factory.mktemp("syn"), n_train=0, n_test=3, n_llava=0, image_size=16,
                              min_images=1, max_images=2, max_turns=3)


def _dialogue_counts(test_json):
    records = json.loads(open(test_json).read())
    answers = sum(sum(m["from"] == "assistant" for m in r["conversations"]) for r in records)
    images = sum(len(r["image"]) for r in records)
    return len(records), answers, images


@pytest.mark.parametrize("name, judged", [("synthetic", False), ("mmdu", True)])
def test_dialogue_benchmarks_count_dialogues_answers_images_and_judge_calls(data, name, judged):
    bench = get_benchmark(name)
    sub = bench.settings(EvalConfig())
    sub.data_path, sub.image_root = data.test_json, data.image_dir
    work, problems = bench.count_work(sub, None)
    dialogues, answers, images = _dialogue_counts(data.test_json)
    assert problems == []
    assert (work.items, work.answers, work.images) == (dialogues, answers, images) and answers > dialogues
    assert work.judge_calls == (answers if judged else 0)


def test_missing_images_and_files_are_problems_not_exceptions(data, tmp_path):
    bench = get_benchmark("mmdu")
    sub = bench.settings(EvalConfig())
    sub.data_path, sub.image_root = data.test_json, str(tmp_path)  # no image is there
    work, problems = bench.count_work(sub, None)
    assert work.items == 0 and len(problems) == 1 and "cannot be evaluated" in problems[0]
    sub.data_path = str(tmp_path / "nope.json")
    work, problems = bench.count_work(sub, None)
    assert problems == [f"eval.mmdu.data_path={sub.data_path!r} does not exist (download the benchmark or set the path)"]
    sub.predictions = str(tmp_path / "answers.json")
    work, problems = bench.count_work(sub, None)
    assert work.note == "scores an existing predictions file" and "eval.mmdu.predictions=" in problems[0]


@pytest.mark.parametrize("name, key, suffix, judge_calls", [("mmvet", "imagename", ".png", 2), ("mdi", "image_path", "", 0)])
def test_single_image_benchmarks_check_each_image(tmp_path, name, key, suffix, judge_calls):
    (tmp_path / "a.png").write_bytes(b"x")
    records = [{key: "a" + suffix}, {key: "b" + suffix}, {key: "a" + suffix}]
    path = tmp_path / "items.json"
    path.write_text(json.dumps({f"v1_{i}": r for i, r in enumerate(records)} if name == "mmvet" else records))
    bench = get_benchmark(name)
    sub = bench.settings(EvalConfig())
    sub.data_path, sub.image_root = str(path), str(tmp_path)
    if name == "mmvet":
        sub.runs = 2
    work, problems = bench.count_work(sub, None)
    assert (work.items, work.answers, work.images, work.judge_calls) == (3, 3, 3, 3 * judge_calls)
    assert problems == [f"eval.{name}: 1 of 3 images are missing under {tmp_path}"]


def test_lmms_eval_counts_nothing_and_names_its_tasks():
    bench = get_benchmark("lmms_eval")
    work, problems = bench.count_work(bench.settings(EvalConfig()), None)
    assert problems == [] and work.items == 0 and work.note.startswith("lmms-eval tasks mmbench_en_dev, mmmu_val")


def test_every_registered_benchmark_counts_its_work_without_a_model():
    # an unconfigured benchmark says what is missing instead of raising
    for name in registered_names():
        bench = get_benchmark(name)
        work, problems = bench.count_work(bench.settings(EvalConfig()), None)
        assert work.name == name and (problems or work.note)


def test_cli_defaults_are_the_generation_section_of_each_benchmark_config():
    from omegaconf import OmegaConf

    for name in registered_names():
        bench = get_benchmark(name)
        path = bench.config_file()
        generation = (OmegaConf.to_container(OmegaConf.load(path)).get("generation") or {}) if path.is_file() else {}
        assert bench.cli_defaults() == {f"generation.{k}": v for k, v in generation.items()}
    assert get_benchmark("mdi").cli_defaults()["generation.max_new_tokens"] == 512


def test_a_wrong_generation_key_in_a_benchmark_config_names_the_file(tmp_path, monkeypatch, capsys):
    from mmtune.evaluation.benchmarks.mdi import MDIBenchmark
    from mmtune.evaluation.cli import main

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "mdi.yaml").write_text("generation:\n  max_new_tokenz: 5\n")
    monkeypatch.setattr(MDIBenchmark, "config_root", str(tmp_path))
    assert get_benchmark("mdi").cli_defaults() == {"generation.max_new_tokenz": 5}
    assert main(["checkpoint", "c", "mdi", "--out", "o"]) == 2
    assert f"{tmp_path}/eval/mdi.yaml: generation.max_new_tokenz is not an eval setting" in capsys.readouterr().err
