import csv
import json
from collections import Counter

import pytest

from mmtune.evaluation.config import JudgeConfig, MMVetConfig
from mmtune.evaluation.fake_judge import FakeJudgeServer, Scripted
from mmtune.evaluation.judge import JudgeClient
from mmtune.evaluation.mmvet import load_items, parse_correctness, score_mmvet, write_official_csvs


@pytest.mark.parametrize("reply, value", [("0.5", 0.5), ("1.0 because", 1.0), ("**0.3**.", 0.3), ("0", 0.0),
                                          ("1.5", None), ("The score is 0.4", None), ("", None), ("-0.1", None)])
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
    cap_csv, int_csv = write_official_csvs(result, str(tmp_path), model="m")
    rows = list(csv.reader(cap_csv.open()))
    assert rows[0] == ["model", "rec", "ocr", "know", "math", "total", "std", "runs"]
    assert rows[1][0] == "m" and rows[1][-3:] == ["50.0", "0.0", "[50.0, 50.0, 50.0]"]
    assert list(csv.reader(int_csv.open()))[0][:4] == ["model", "rec_know", "ocr", "ocr_math"]
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
