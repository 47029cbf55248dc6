import json

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
    assert "eval.mmvet.data_path is required" in capsys.readouterr().err


def test_lmms_command_and_parse(tmp_path, capsys):
    from pathlib import Path

    assert main(["lmms-command", "/ckpt", "--tasks", "ai2d,mmstar", "--out", "/o"]) == 0
    assert "--model llava_hf --model_args pretrained=/ckpt --tasks ai2d,mmstar" in capsys.readouterr().out
    fixture = Path(__file__).parent / "fixtures" / "lmms_eval_results.json"
    assert main(["lmms-parse", str(fixture), "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.glob("*.json")} == {"ai2d.json", "chartqa.json", "mmmu_val.json"}
    assert main(["report", str(tmp_path)]) == 0 and "## ai2d" in (tmp_path / "report.md").read_text()
