import json

import pytest

from mmtune.evaluation.cli import main
from tests.support.fake_judge import FakeJudgeServer, Scripted


def test_score_mmvet_results_json_without_images(tmp_path, monkeypatch, capsys):
    (tmp_path / "mm-vet.json").write_text(json.dumps({
        "v1_0": {"imagename": "missing.png", "question": "Q0", "answer": "A0", "capability": ["ocr"]},
        "v1_1": {"imagename": "missing.png", "question": "Q1", "answer": "A1", "capability": ["rec"]},
    }))
    (tmp_path / "results.json").write_text(json.dumps({"v1_0": "right", "v1_1": "wrong"}))
    with FakeJudgeServer(lambda b: Scripted("1.0" if "| right |" in b["messages"][-1]["content"] else "0.0")) as server:
        monkeypatch.setenv("MMTUNE_JUDGE_BASE_URL", server.base_url)
        monkeypatch.setenv("MMTUNE_JUDGE_MODEL", "judge")
        code = main(["score", "mmvet", "--data", str(tmp_path / "mm-vet.json"), "--predictions", str(tmp_path / "results.json"),
                     "--out", str(tmp_path / "out"), "--runs", "2", "--quiet"])
        assert code == 0 and len(server.requests) == 4  # 2 items x 2 runs
    result = json.loads((tmp_path / "out" / "mmvet.json").read_text())
    assert result["metrics"]["total"] == 50.0 and result["metrics"]["ocr"] == 100.0 and result["metrics"]["rec"] == 0.0
    assert (tmp_path / "out" / "external_judge-cap-score-2runs.csv").exists() and (tmp_path / "out" / "report.md").exists()
    assert "mmvet:" in capsys.readouterr().out


def test_score_mdi_and_mmdu_predictions(tmp_path, monkeypatch):
    items = [{"question number": 1, "key": "level1-sport-old", "image_path": "x", "question": "q", "option": "A.1; B.2", "answer": "B", "response": "<Answer>: <<B>>"},
             {"question number": 2, "key": "level2-sport-old", "image_path": "y", "question": "q", "option": "A.1; B.2", "answer": "A", "response": "A chart"}]
    (tmp_path / "mdi.json").write_text(json.dumps(items))
    assert main(["score", "mdi", "--predictions", str(tmp_path / "mdi.json"), "--out", str(tmp_path / "o1"), "--quiet"]) == 0
    assert json.loads((tmp_path / "o1" / "mdi.json").read_text())["metrics"]["score_final"] == 50.0  # 0.5 * 100 + 0.5 * 0

    bench = [{"id": "d", "image": ["/p/a.jpg"], "conversations": [{"from": "user", "value": "<ImageHere> Q?"}, {"from": "assistant", "value": "REF"}]}]
    answers = [{"id": "d", "image": ["/p/a.jpg"], "conversations": [{"from": "user", "value": "<ImageHere> Q?"}, {"from": "assistant", "value": "MINE"}]}]
    (tmp_path / "b.json").write_text(json.dumps(bench))
    (tmp_path / "a.json").write_text(json.dumps(answers))
    reply = "Overall Score: 7\nCreativity: 7\nRichness: 7\nVisual Perception: 7\nLogical Coherence: 7\nAnswer Accuracy: 7\nImage Relationship Understanding: 7"
    with FakeJudgeServer(lambda b: Scripted(reply)) as server:
        monkeypatch.setenv("MMTUNE_JUDGE_BASE_URL", server.base_url)
        code = main(["score", "mmdu", "--data", str(tmp_path / "b.json"), "--predictions", str(tmp_path / "a.json"),
                     "--out", str(tmp_path / "o2"), "--judge-model", "j", "--quiet"])
        assert code == 0 and "[Assistant's Answer]\nMINE" in server.prompts()[0]
    assert json.loads((tmp_path / "o2" / "mmdu.json").read_text())["metrics"]["Overall"] == 70.0


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["score", "mmvet", "--predictions", str(tmp_path / "none.json"), "--out", str(tmp_path)]) == 2
    # the message names this command's flag, not the config key behind it
    err = capsys.readouterr().err
    assert "--data is required" in err and "eval.mmvet.data_path" not in err


def test_lmms_command_and_parse(tmp_path, capsys):
    from pathlib import Path

    assert main(["lmms-command", "/ckpt", "--tasks", "ai2d,mmstar", "--out", "/o"]) == 0
    assert "--model llava_hf --model_args pretrained=/ckpt --tasks ai2d,mmstar" in capsys.readouterr().out
    fixture = Path(__file__).parent / "fixtures" / "lmms_eval_results.json"
    assert main(["lmms-parse", str(fixture), "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.glob("*.json")} == {"ai2d.json", "chartqa.json", "mmmu_val.json"}
    assert main(["report", str(tmp_path)]) == 0 and "## ai2d" in (tmp_path / "report.md").read_text()


def _flag_value(kind):
    return {int: "7", float: "0.25", str: "some/value"}[kind]


def _scalar_fields(settings_class):
    import dataclasses
    import typing

    hints = typing.get_type_hints(settings_class)
    for field in dataclasses.fields(settings_class):
        kind = hints[field.name]
        if typing.get_origin(kind) is typing.Union:
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if kind in (int, float, str):
            yield field.name, kind


def test_every_setting_of_every_benchmark_is_a_flag_of_its_commands():
    from mmtune.evaluation.benchmarks.registry import get_benchmark, registered_names
    from mmtune.evaluation.cli import build_parser, config_from_args

    parser = build_parser()
    benches = [get_benchmark(n) for n in registered_names() if get_benchmark(n).generates]
    assert {b.name for b in benches} >= {"synthetic", "mmdu", "mmvet", "mdi"}
    for bench in benches:
        for name, kind in _scalar_fields(bench.settings_class):
            flag = "--data" if name == "data_path" else f"--{name.replace('_', '-')}"
            if flag == "--judge-model":  # the judge's own flag; the benchmark's setting is prefixed
                flag = f"--{bench.name}-judge-model"
            required = [] if name == "predictions" else ["--predictions", "p.json"]
            args = parser.parse_args(["score", bench.name, "--out", "o", *required, flag, _flag_value(kind)])
            value = getattr(getattr(config_from_args(args), bench.name), name)
            assert value == kind(_flag_value(kind)), (bench.name, name)


def test_a_flag_of_another_benchmark_is_refused(capsys):
    import pytest

    from mmtune.evaluation.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["score", "mdi", "--predictions", "p.json", "--out", "o", "--runs", "3"])
    assert "unrecognized arguments: --runs 3" in capsys.readouterr().err


def test_checkpoint_decodes_as_the_benchmark_config_unless_a_flag_says_otherwise():
    from omegaconf import OmegaConf

    from mmtune.data.config import configs_dir
    from mmtune.evaluation.cli import build_parser, config_from_args

    parser = build_parser()
    for name in ("synthetic", "heldout", "mmdu", "mmvet", "mdi"):
        expected = OmegaConf.load(configs_dir() / "eval" / f"{name}.yaml").generation.max_new_tokens
        cfg = config_from_args(parser.parse_args(["checkpoint", "ckpt", name, "--out", "o"]))
        assert cfg.generation.max_new_tokens == expected and cfg.benchmarks == [name]
        cfg = config_from_args(parser.parse_args(["checkpoint", "ckpt", name, "--out", "o", "--max-new-tokens", "5",
                                                  "--no-kv-reuse", "--batch-size", "3", "--quiet"]))
        assert (cfg.generation.max_new_tokens, cfg.generation.kv_reuse, cfg.generation.batch_size, cfg.progress) == (
            5, False, 3, False)
    assert {32, 512, 1024, 2048} == {
        config_from_args(parser.parse_args(["checkpoint", "c", n, "--out", "o"])).generation.max_new_tokens
        for n in ("synthetic", "mmdu", "mmvet", "mdi")}


def test_checkpoint_command_generates_with_the_benchmark_defaults(tmp_path):
    from mmtune.data.synthetic import generate_synthetic
    from mmtune.evaluation.cli import main
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    data = generate_synthetic(tmp_path / "syn", n_train=0, n_test=2, n_llava=0, image_size=56, max_turns=2)
    adapter = build_adapter(ModelConfig(family="llava"))
    adapter.load_model(seed=0).save_pretrained(tmp_path / "final")
    adapter.save_pretrained(str(tmp_path / "final"))
    assert main(["checkpoint", str(tmp_path / "final"), "synthetic", "--data", data.test_json, "--image-root",
                 data.image_dir, "--out", str(tmp_path / "out"), "--quiet", "--batch-size", "2"]) == 0
    result = json.loads((tmp_path / "out" / "synthetic.json").read_text())
    assert result["meta"]["generation"]["max_new_tokens"] == 32 and result["meta"]["generation"]["batch_size"] == 2
    records = json.loads(open(data.test_json).read())
    assert result["counts"]["turns"] == sum(sum(m["from"] == "user" for m in r["conversations"]) for r in records)


@pytest.mark.slow  # two evaluations end to end
def test_two_evaluations_into_one_folder_the_second_is_refused(tmp_path):
    """Two real processes score two models' answers into the same --out. Unlocked, both exit 0
    and the folder ends up holding a mix; locked, the second stops at once naming the first
    (pid, command), and the folder holds the first model's results only."""
    import os
    import subprocess
    import sys
    import threading
    import time

    conversations = []
    for t in range(3):
        conversations += [{"from": "user", "value": f"Q{t}?"}, {"from": "assistant", "value": f"R{t}"}]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([{"id": "d0", "image": [], "conversations": conversations}]))
    answers = {}
    for model in ("first", "second"):
        turns = [dict(c, value=f"{model} answer {i}") if c["from"] == "assistant" else c
                 for i, c in enumerate(conversations)]
        answers[model] = tmp_path / f"{model}.json"
        answers[model].write_text(json.dumps([{"id": "d0", "image": [], "conversations": turns}]))
    release = threading.Event()
    reply = "{" + ", ".join(f'"{k}": 7' for k in ("Creativity", "Richness", "Visual Perception", "Logical Coherence",
                                                   "Answer Accuracy", "Image Relationship Understanding",
                                                   "Overall Score")) + "}"
    out = tmp_path / "out"

    def command(model):
        return [sys.executable, "-m", "mmtune.cli", "evaluate", "score", "mmdu", "--data", str(bench), "--predictions",
                str(answers[model]), "--model", model, "--out", str(out), "--judge-model", "judge", "--quiet"]

    # the judge holds the first evaluation mid-run (bounded: it lets go after 60 s whatever happens)
    with FakeJudgeServer(lambda body: Scripted(reply) if release.wait(60) else Scripted(reply)) as server:
        env = dict(os.environ, MMTUNE_JUDGE_BASE_URL=server.base_url, OMP_NUM_THREADS="1")
        first = subprocess.Popen(command("first"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.time() + 120
            while not server.requests and first.poll() is None and time.time() < deadline:
                time.sleep(0.05)
            assert server.requests, "the first evaluation never reached its judge"
            second = subprocess.run(command("second"), env=env, capture_output=True, text=True, timeout=120)
        finally:
            release.set()
            stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    assert second.returncode == 2
    assert f"{out} is in use by another process: pid {first.pid}" in second.stderr
    assert "evaluate score mmdu" in second.stderr and "(evaluation)" in second.stderr and "--out" in second.stderr
    details = [json.loads(line) for line in (out / "details" / "mmdu.jsonl").read_text().splitlines()]
    assert len(details) == 3 and {json.loads((out / "mmdu.json").read_text())["model"]} == {"first"}
    assert not any("second" in p for p in server.prompts())  # the refused run asked the judge nothing


def test_a_run_label_holding_a_secret_is_redacted_in_every_file(tmp_path, monkeypatch):
    key = "sk-test-SECRET-4f7a9c0123"
    monkeypatch.setenv("MMTUNE_JUDGE_API_KEY", key)
    bench = tmp_path / "test.json"
    bench.write_text(json.dumps([{"id": "d0", "image": [], "conversations": [
        {"from": "user", "value": "Q?"}, {"from": "assistant", "value": "red"}]}]))
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"dialogue_id": "d0", "turn": 0, "answer": "red"}) + "\n")
    out = tmp_path / "out"
    assert main(["score", "synthetic", "--data", str(bench), "--predictions", str(answers), "--out", str(out),
                 "--run", f"run-{key}", "--model", f"model-{key}", "--quiet"]) == 0
    result = json.loads((out / "synthetic.json").read_text())
    assert result["run"] == "run-***" and result["model"] == "model-***"
    written = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"synthetic.json", "report.md", "viewer.html"}
    assert not [p.name for p in written if key.encode() in p.read_bytes()]
