"""heldout: your own held-out dialogues in any data format, scored by exact match, viewed and counted."""

import json
import re

import pytest
from PIL import Image

from mmtune.evaluation.benchmarks.registry import get_benchmark
from mmtune.evaluation.config import EvalConfig
from mmtune.evaluation.runner import run_benchmarks

# two dialogues (one image each, two turns), written in every format data.files takes
QUESTIONS = [("d1", "red", [("What colour is it?", "red"), ("Is it bright?", "yes")]),
             ("d2", "blue", [("What colour is it?", "blue"), ("Is it bright?", "no")])]


def _records(fmt):
    out = []
    for rid, colour, turns in QUESTIONS:
        if fmt == "messages":
            messages = []
            for k, (q, a) in enumerate(turns):
                content = [{"type": "image", "path": f"imgs/{colour}.png"}, {"type": "text", "text": q}] if k == 0 else q
                messages += [{"role": "user", "content": content}, {"role": "assistant", "content": a}]
            out.append({"id": rid, "messages": messages})
            continue
        mark = "<image>" if fmt == "llava" else "<ImageHere>"
        user, bot = {"llava": ("human", "gpt"), "mmdu": ("user", "assistant"), "xcomposer2": ("user", "bot")}[fmt]
        conversations = []
        for k, (q, a) in enumerate(turns):
            conversations += [{"from": user, "value": f"{mark}\n{q}" if k == 0 else q}, {"from": bot, "value": a}]
        image = f"imgs/{colour}.png" if fmt == "llava" else [f"imgs/{colour}.png"]
        out.append({"id": rid, "image": image, "conversations": conversations})
    return out


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MMTUNE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "imgs").mkdir()
    for colour, rgb in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
        Image.new("RGB", (32, 32), rgb).save(tmp_path / "imgs" / f"{colour}.png")
    # answers by (dialogue, position of the exchange): d1 both right, d2 one right
    answers = [("d1", 0, "Red."), ("d1", 1, "yes"), ("d2", 0, "blue"), ("d2", 1, "yes")]
    (tmp_path / "answers.jsonl").write_text("".join(
        json.dumps({"dialogue_id": d, "turn": t, "answer": a}) + "\n" for d, t, a in answers))
    return tmp_path


@pytest.mark.parametrize("fmt", ["llava", "mmdu", "xcomposer2", "messages"])
def test_any_data_format_is_read_scored_numbered_from_one_and_viewed(folder, fmt):
    path = folder / ("held.jsonl" if fmt == "messages" else "held.json")
    records = _records(fmt)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) if fmt == "messages" else json.dumps(records))
    cfg = EvalConfig(benchmarks=["heldout"], progress=False)
    cfg.heldout.data_path, cfg.heldout.predictions = str(path), str(folder / "answers.jsonl")
    out = folder / "eval"
    result = run_benchmarks(cfg, output_dir=str(out), run_name="r", model_label="m")["heldout"]
    assert result.benchmark == "heldout" and result.metrics["exact_match"] == pytest.approx(75.0)
    assert result.metrics["turn/1"] == pytest.approx(100.0) and result.metrics["turn/2"] == pytest.approx(50.0)
    rows = [json.loads(line) for line in (out / "details" / "heldout.jsonl").read_text().splitlines()]
    assert [(r["dialogue_id"], r["turn"], r["correct"]) for r in rows] == [
        ("d1", 1, True), ("d1", 2, True), ("d2", 1, True), ("d2", 2, False)]
    assert "## heldout" in (out / "report.md").read_text() and (out / "heldout_by_turn.png").is_file()
    page = (out / "viewer.html").read_text()
    block = json.loads(re.search(r'<script id="viewer-data" type="application/json">(.*?)</script>', page, re.S).group(1))
    (tab,) = block["benchmarks"]
    entries = {e["id"]: e for e in tab["entries"]}
    assert [t["status"] for t in entries["d2"]["turns"]] == ["correct", "wrong"]
    assert entries["d1"]["turns"][0]["images"] and entries["d2"]["score"] == pytest.approx(50.0)
    cfg.heldout.predictions = None  # what generating would take (mmtune plan)
    work, problems = get_benchmark("heldout").count_work(cfg.heldout, str(folder / "cache"))
    assert problems == [] and (work.items, work.answers, work.images, work.judge_calls) == (2, 4, 2, 0)


def test_a_held_out_record_that_cannot_be_read_stops_the_evaluation_with_the_data_report(folder):
    records = _records("mmdu")
    records[1]["image"] = ["imgs/gone.png"]
    path = folder / "held.json"
    path.write_text(json.dumps(records))
    cfg = EvalConfig(benchmarks=["heldout"], progress=False)
    cfg.heldout.data_path, cfg.heldout.predictions = str(path), str(folder / "answers.jsonl")
    with pytest.raises(ValueError) as info:
        run_benchmarks(cfg, output_dir=str(folder / "eval"), run_name="r", model_label="m")
    message = str(info.value)
    assert "1 of 2 held-out dialogue(s) cannot be evaluated" in message and f"mmtune data check {path}" in message
    assert "missing_image" in message and "d2 turn 1 (question)" in message


def test_settings_are_checked_before_anything_runs(folder):
    cfg = EvalConfig(benchmarks=["heldout"])
    assert get_benchmark("heldout").check(cfg) == ["eval.heldout.data_path is required: it holds the questions and "
                                                   "reference answers"]
    cfg.heldout.data_path, cfg.heldout.format = "x.json", "csv"
    assert any("eval.heldout.format='csv' is unknown" in p for p in get_benchmark("heldout").check(cfg))
