import json

import pytest

from mmtune.evaluation.benchmarks.common import TurnPrediction, load_mmdu_dialogues
from mmtune.data.dialogue import Dialogue, Turn
from mmtune.evaluation.benchmarks.synthetic import score_synthetic


def test_correct_answers_follow_the_data_rule():
    """Case, whitespace runs and surrounding punctuation do not count; inner text does."""
    reference = "the shape is a red square."
    dialogue = Dialogue("d", "synthetic", (Turn("user", ("Shape?",)), Turn("assistant", (reference,))) * 3, {})
    answers = ["  The shape is a Red Square! ", "the shape is a redsquare", "the shape, is a red square"]
    preds = {("d", t): TurnPrediction(a, {}) for t, a in enumerate(answers)}
    _, records = score_synthetic([dialogue], preds, run="r", model="m")
    assert [r["correct"] for r in records] == [True, False, False]


def test_exact_match_and_per_turn(tmp_path):
    path = tmp_path / "test.json"
    path.write_text(json.dumps([
        {"id": "s0", "image": ["a.png"], "conversations": [
            {"from": "user", "value": "Image1: <ImageHere>. What colour?"}, {"from": "assistant", "value": "Red."},
            {"from": "user", "value": "Shape?"}, {"from": "assistant", "value": "A square."}]},
        {"id": "s1", "image": [], "conversations": [
            {"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Yes"},
            {"from": "user", "value": "Again"}, {"from": "assistant", "value": "No"}]},
    ]))
    dialogues = load_mmdu_dialogues(path)
    preds = {("s0", 0): TurnPrediction("red", {}), ("s0", 1): TurnPrediction("a circle", {}), ("s1", 0): TurnPrediction("YES!", {})}
    result, records = score_synthetic(dialogues, preds, run="r", model="m")
    assert result.metrics["exact_match"] == pytest.approx(50.0)
    # turns are numbered from 1 in metrics and detail rows, as data check, report.md and the viewer do
    assert result.metrics["turn/1"] == pytest.approx(100.0) and result.metrics["turn/2"] == pytest.approx(0.0)
    assert "turn/0" not in result.metrics
    assert [(r["dialogue_id"], r["turn"]) for r in records] == [("s0", 1), ("s0", 2), ("s1", 1), ("s1", 2)]
    assert result.counts == {"turns": 4, "dialogues": 2, "correct": 2, "missing": 1}
