import csv
import json
from collections import Counter

import pytest

from mmtune.evaluation.benchmarks.mmvet import MMVetConfig
from mmtune.evaluation.config import JudgeConfig
from tests.support.fake_judge import FakeJudgeServer, Scripted
from mmtune.evaluation.judge.client import JudgeClient
from mmtune.evaluation.benchmarks.mmvet import (
    load_items,
    load_predictions,
    parse_correctness,
    runs_from_grades,
    score_mmvet,
    write_official_files,
)


@pytest.mark.parametrize("reply, value", [("0.5", 0.5), ("1.0 because", 1.0), ("**0.3**.", 0.3), ("0", 0.0),
                                          ("1.5", None), ("The score is 0.4", None), ("", None), ("-0.1", None),
                                          # a decimal comma is no number: "0,5" is not read as 0
                                          ("0,5", None), ("1,0", None), ("0, because", 0.0), ("1.0, 1.0", 1.0),
                                          ("NaN", None), ("0.5.1", None), ("0x1", None), ("0.4th", 0.4),
                                          (None, None), (0.5, None)])
def test_parse_correctness(reply, value):
    assert parse_correctness(reply) == value


def _items(tmp_path):
    data = {
        "v1_0": {"imagename": "v1_0.png", "question": "Q0", "answer": "A0", "capability": ["rec", "know"]},
        "v1_1": {"imagename": "v1_1.png", "question": "Q1", "answer": "A1", "capability": ["ocr"]},
        "v1_2": {"imagename": "v1_2.png", "question": "Q2", "answer": "A2", "capability": ["know", "rec"]},
        "v1_3": {"imagename": "v1_3.png", "question": "Q3", "answer": "A3", "capability": ["ocr", "math"]},
    }
    path = tmp_path / "mm-vet.json"
    path.write_text(json.dumps(data))
    return load_items(str(path))


def test_runs_retry_rule_tables_and_csv(tmp_path):
    items = _items(tmp_path)
    predictions = {"v1_0": "P0", "v1_1": "P1", "v1_2": "P2"}  # v1_3 missing -> 0
    seen = Counter()

    def respond(body):
        prompt = body["messages"][-1]["content"]
        last_row = prompt.strip().splitlines()[-1]
        seen[(last_row, body["temperature"])] += 1
        if last_row.startswith("Q0"):
            return Scripted("1.0")
        if last_row.startswith("Q1"):
            # garbage at temperature 0 and 0.5, a number at 1.0 -> third try
            return Scripted("1.0" if body["temperature"] >= 1.0 else "Correctness: high")
        return Scripted("unparsable forever")  # Q2: 5 tries then 0

    with FakeJudgeServer(respond) as server:
        judge = JudgeClient(JudgeConfig(model="j"), cache_path=tmp_path / "c.sqlite", env={"MMTUNE_JUDGE_BASE_URL": server.base_url})
        result, runs = score_mmvet(items, predictions, judge, MMVetConfig(runs=3), run="r", model="m")
        calls = len(server.requests)
    # each run really calls the judge: Q0 1 call, Q1 3 calls, Q2 5 calls -> 9 per run, 3 runs
    assert calls == 27
    assert sorted({t for (row, t) in seen if row.startswith("Q2")}) == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert [s.tries for s in runs[0]] == [1, 3, 5, 0]
    # per item: 1.0, 1.0, 0, 0 -> total 50; rec = (1 + 0)/2 = 50; ocr = (1 + 0)/2 = 50; know 50; math 0
    assert result.metrics["total"] == pytest.approx(50.0) and result.metrics["total_std"] == pytest.approx(0.0)
    assert result.metrics["rec"] == pytest.approx(50.0) and result.metrics["math"] == pytest.approx(0.0)
    assert result.metrics["int/rec_know"] == pytest.approx(50.0) and result.metrics["int/ocr"] == pytest.approx(100.0)
    assert result.metrics["int/ocr_math"] == pytest.approx(0.0)
    assert result.counts["unparsed"] == 3 and result.counts["missing"] == 1
    paths = write_official_files(items, runs, str(tmp_path), model="m", judge_model="j")
    rows = list(csv.reader(paths["cap"].open()))
    assert paths["cap"].name == "m_j-cap-score-3runs.csv"
    assert rows[0] == ["", "rec", "know", "ocr", "math", "total", "std", "runs"]
    assert rows[1][0] == "m" and rows[1][-3:] == ["50.0", "0.0", "[50.0, 50.0, 50.0]"]
    assert list(csv.reader(paths["cap_int"].open()))[0][:4] == ["", "rec_know", "ocr", "ocr_math"]
    # valid judgements only: Q0 and Q1 scored 1.0; Q2 unparsed and Q3 missing are left out
    assert result.metrics["valid/total"] == pytest.approx(100.0) and result.counts["valid"] == 6
    # a re-run pays nothing
    with FakeJudgeServer(respond) as server:
        judge = JudgeClient(JudgeConfig(model="j"), cache_path=tmp_path / "c.sqlite", env={"MMTUNE_JUDGE_BASE_URL": server.base_url})
        again, _ = score_mmvet(items, predictions, judge, MMVetConfig(runs=3), run="r", model="m")
        assert len(server.requests) == 0 and again.metrics == result.metrics


def test_mean_and_std_over_runs(tmp_path):
    items = _items(tmp_path)[:2]
    by_run = {}

    def respond(body):
        # the run index only lives in our cache key, so count calls per prompt to vary replies by run
        prompt = body["messages"][-1]["content"]
        by_run[prompt] = by_run.get(prompt, 0) + 1
        return Scripted(["1.0", "0.5"][by_run[prompt] - 1] if prompt.strip().endswith("P0 |") else "0.0")

    with FakeJudgeServer(respond) as server:
        judge = JudgeClient(JudgeConfig(model="j"), env={"MMTUNE_JUDGE_BASE_URL": server.base_url})
        result, _ = score_mmvet(items, {"v1_0": "P0", "v1_1": "P1"}, judge, MMVetConfig(runs=2), run="r", model="m")
    # run totals: (1 + 0)/2 = 50 and (0.5 + 0)/2 = 25 -> mean 37.5, population std 12.5
    assert result.meta["run_totals"] == pytest.approx([50.0, 25.0])
    assert result.metrics["total"] == pytest.approx(37.5) and result.metrics["total_std"] == pytest.approx(12.5)


RECORDED = {  # an official-format grade file: two runs per item
    "v1_0": {"model": ["gpt-4-0613"] * 2, "content": ["1.0", "1.0"], "score": [1.0, 1.0]},
    "v1_1": {"model": ["gpt-4-0613"] * 2, "content": ["0.5", "0.0"], "score": [0.5, 0.0]},
    "v1_2": {"model": ["gpt-4-0613"] * 2, "content": ["0.0", "0.0"], "score": [0.0, 0.0]},
    "v1_3": {"model": ["gpt-4-0613"] * 2, "content": ["1.0", "1.0"], "score": [1.0, 1.0]},
    "v1_4": {"model": ["gpt-4-0613"] * 2, "content": ["0.4", "0.6"], "score": [0.4, 0.6]},
    "v1_5": {"model": ["gpt-4-0613"] * 2, "content": ["0.0", "1.0"], "score": [0.0, 1.0]},
}


def test_official_layout_on_recorded_grades(tmp_path):
    data = {
        "v1_0": {"imagename": "a.png", "question": "q", "answer": "a", "capability": ["rec"]},
        "v1_1": {"imagename": "a.png", "question": "q", "answer": "a", "capability": ["ocr", "math"]},
        "v1_2": {"imagename": "a.png", "question": "q", "answer": "a", "capability": ["rec"]},
        "v1_3": {"imagename": "a.png", "question": "q", "answer": "a", "capability": ["ocr", "math"]},
        "v1_4": {"imagename": "a.png", "question": "q", "answer": "a", "capability": ["rec", "know", "gen"]},
        "v1_5": {"imagename": "a.png", "question": "q", "answer": "a", "capability": ["ocr"]},
    }
    (tmp_path / "mm-vet.json").write_text(json.dumps(data))
    items = load_items(str(tmp_path / "mm-vet.json"))
    runs = runs_from_grades(RECORDED, items)
    paths = write_official_files(items, runs, str(tmp_path / "out"), model="llava_7b", judge_model="gpt-4-0613")
    assert {k: p.name for k, p in paths.items()} == {
        "cap": "llava_7b_gpt-4-0613-cap-score-2runs.csv",
        "cap_int": "llava_7b_gpt-4-0613-cap-int-score-2runs.csv",
        "grade": "llava_7b_gpt-4-0613-grade-2runs.json",
    }
    # capabilities by number of items (rec 3, ocr 3, math 2, know 1, gen 1; ties in first-seen order);
    # run totals 48.33 and 60.0 -> mean 54.2, population std 5.8
    assert paths["cap"].read_text() == (
        ",rec,ocr,math,know,gen,total,std,runs\n"
        'llava_7b,50.0,58.3,62.5,50.0,50.0,54.2,5.8,"[48.3, 60.0]"\n'
    )
    # capability sets by number of items: rec (2), ocr_math (2), rec_know_gen (1), ocr (1)
    assert paths["cap_int"].read_text() == (
        ",rec,ocr_math,rec_know_gen,ocr,total,std,runs\n"
        'llava_7b,50.0,62.5,50.0,50.0,54.2,5.8,"[48.3, 60.0]"\n'
    )
    assert json.loads(paths["grade"].read_text()) == RECORDED
    bard = write_official_files(items, runs, str(tmp_path / "out"), model="llava_7b", judge_model="gpt-4-0613", bard_subset=True)
    assert bard["cap"].name == "llava_7b_bardset_gpt-4-0613-cap-score-2runs.csv"


def test_prediction_files_of_common_tools(tmp_path):
    (tmp_path / "official.json").write_text(json.dumps({"v1_0": "cat", "v1_1": "dog"}))
    (tmp_path / "llava.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 0, "prompt": "q", "text": "cat", "answer_id": "x", "model_id": "llava"},
        {"question_id": "v1_1", "prompt": "q", "text": "dog"},
    ]))
    (tmp_path / "records.json").write_text(json.dumps({"v1_0": {"answer": "cat"}, "v1_1": {"text": "dog"}}))
    for name in ("official.json", "llava.jsonl", "records.json"):
        assert load_predictions(str(tmp_path / name)) == {"v1_0": "cat", "v1_1": "dog"}
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no id"}))
    with pytest.raises(ValueError, match="record 1 has no question_id"):
        load_predictions(str(tmp_path / "bad.jsonl"))


def test_bard_subset_and_prompt_marking(tmp_path):
    items = _items(tmp_path)
    (tmp_path / "bard_set.json").write_text(json.dumps({"v1_1": {}, "v1_3": {}}))
    subset = load_items(str(tmp_path / "mm-vet.json"), subset=str(tmp_path / "bard_set.json"))
    assert [i.id for i in subset] == ["v1_1", "v1_3"]
    official = tmp_path / "official_prompt.txt"
    official.write_text("Compare the ground truth and prediction. Just complete the last space.\n\nQuestion | Ground truth | Prediction | Correctness\n--- | --- | --- | ---\n")
    prompts = []

    def respond(body):
        prompts.append(body["messages"][-1]["content"])
        return Scripted("0.5")

    with FakeJudgeServer(respond) as server:
        judge = JudgeClient(JudgeConfig(model="j"), env={"MMTUNE_JUDGE_BASE_URL": server.base_url})
        cfg = MMVetConfig(runs=1, prompt_file=str(official), judge_model="gpt-4-0613")
        result, _ = score_mmvet(items[:1], {"v1_0": "P0"}, judge, cfg, run="r", model="m")
        assert server.requests[0]["model"] == "gpt-4-0613" and server.requests[0]["max_tokens"] == 3
    # the official prompt: the row is appended after a newline, <AND>/<OR> spaced, an empty last cell
    assert prompts[0] == official.read_text() + "\nQ0 | A0 | P0 | "
    meta = result.meta
    assert meta["prompt"]["name"] == "official_prompt.txt" and meta["prompt"]["official"] is True
    assert len(meta["prompt"]["sha256"]) == 64
    # not the official text (its hash differs) and one run: not comparable, and the report says why
    assert meta["comparable_with_published"] is False
    assert any("not the official MM-Vet prompt" in n for n in meta["comparability_notes"])
    assert any("1 judge run" in n for n in meta["comparability_notes"])
