import json

import pytest

from mmtune.evaluation.common import TurnPrediction, load_mmdu_dialogues
from mmtune.evaluation.synthetic import normalize, score_synthetic


def test_normalize():
    assert normalize("  The shape is a Red Square! ") == normalize("the shape is a red square.") == "theshapeisaredsquare"


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
    assert result.metrics["turn/0"] == pytest.approx(100.0) and result.metrics["turn/1"] == pytest.approx(0.0)
    assert result.counts == {"turns": 4, "dialogues": 2, "correct": 2, "missing": 1}
