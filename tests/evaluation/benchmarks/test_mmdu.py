import json

import pytest

from mmtune.evaluation.benchmarks.common import TurnPrediction, load_mmdu_dialogues
from mmtune.evaluation.benchmarks.mmdu import MMDUConfig
from mmtune.evaluation.config import JudgeConfig
from tests.support.fake_judge import FakeJudgeServer, Scripted
from mmtune.evaluation.judge.client import JudgeClient
from mmtune.evaluation.benchmarks.mmdu import TurnScore, aggregate, parse_scores

FULL = {"C": 5.0, "R": 6.0, "VP": 7.0, "LC": 8.0, "AA": 6.0, "IRU": 5.0, "Overall": 6.0}


@pytest.mark.parametrize(
    "reply, method",
    [
        ('Fine answer.\n{"Creativity": 5, "Richness": 6, "Visual Perception": 7, "Logical Coherence": 8, "Answer Accuracy": 6, "Image Relationship Understanding": 5, "Overall Score": 6}', "json"),
        ("Explanation...\n{'Creativity': 5, 'Richness': 6, 'Visual Perception': 7, 'Logical Coherence': 8, 'Answer Accuracy': 6, 'Image Relationship Understanding': 5, 'Overall Score': 6}", "literal"),
        ("```python\n{'Creativity': '5', 'Richness': '6', 'Visual Perception': '7', 'Logical Coherence': '8', 'Answer Accuracy': '6', 'Image Relationship Understanding': '5', 'Overall Score': '6'}\n```", "literal"),
        ("Scores:\nCreativity: 5\nRichness: 6\nVisual Perception: 7\nLogical Coherence: 8\nAnswer Accuracy: 6\nImage Relationship Understanding: 5\nOverall Score: 6", "lines"),
        ("- **Creativity**: 5/10\n- **Richness**: 6/10\n- **Visual Perception**: 7\n- **Logical Coherence**: 8\n- **Answer Accuracy**: 6\n- **Image Relationship Understanding**: 5\n- **Overall Score**: 6", "lines"),
        ("{Creativity: 5, Richness: 6, Visual_Perception: 7, Logical_Coherence: 8, Answer_Accuracy: 6, Image_Relationship_Understanding: 5, Overall: 6}", "pairs-in-block"),
        # a draft dict early in the reasoning, the final one last: the last block wins
        ('Draft {"Creativity": 1} ... final:\n{"Creativity": 5, "Richness": 6, "Visual Perception": 7, "Logical Coherence": 8, "Answer Accuracy": 6, "Image Relationship Understanding": 5, "Overall Score": 6}', "json"),
    ],
)
def test_parse_variants(reply, method):
    parsed = parse_scores(reply)
    assert parsed.ok and parsed.method == method
    assert parsed.scores == FULL and parsed.na == []


_KEYS = ("Creativity", "Richness", "Visual Perception", "Logical Coherence", "Answer Accuracy",
         "Image Relationship Understanding", "Overall Score")


def _lines(last: str) -> str:
    """Seven ``Key: value`` lines: 5 for the first six keys, ``last`` for Overall Score."""
    return "\n".join(f"{k}: {5 if k != 'Overall Score' else last}" for k in _KEYS)


@pytest.mark.parametrize("value, expected", [
    ("N/A", None), ("NA", None), ("n/a", None), ("N / A", None), ("7", 7.0), ("7/10", 7.0), ("7.", 7.0),
    ("8.5", 8.5), ("7, since", 7.0),
    # not a value at all: a word that starts like N/A, NaN, a decimal comma, a number that goes on
    ("NaN", "no value"), ("Nancy", "no value"), ("Nah", "no value"), ("N/Apple", "no value"),
    ("8,5", "no value"), ("8,50", "no value"), ("7x2", "no value"), ("8.5.1", "no value"),
])
def test_na_and_numbers_are_read_whole(value, expected):
    parsed = parse_scores(_lines(value))
    if expected == "no value":
        assert not parsed.ok and "no value for Overall Score" in parsed.error, parsed
    else:
        assert parsed.ok and parsed.scores["Overall"] == expected, parsed
        assert parsed.na == ([] if expected is not None else ["Overall"])


@pytest.mark.parametrize("reply", ['{"Overall Score": NaN}', "{'Overall Score': 'NaN'}", "{'Overall Score': 'Nancy'}",
                                   '{"Overall Score": "8,5"}', '{"Overall Score": Infinity}'])
def test_a_dict_value_that_is_no_score_is_not_na(reply):
    others = ", ".join(f'"{k}": 5' for k in _KEYS if k != "Overall Score")
    parsed = parse_scores(reply.replace("{", "{" + others + ", ", 1))
    assert not parsed.ok and "Overall Score" in parsed.error and "is not a score in 1..10 or N/A" in parsed.error


def test_a_long_reply_is_read_from_its_tail_only():
    """The verdict follows the reasoning: a reply longer than the cap is read from its last
    MAX_REPLY_CHARS characters, so no reply costs more than that to parse."""
    from mmtune.evaluation.benchmarks.mmdu import MAX_REPLY_CHARS

    early = "{" + ", ".join(f'"{k}": 9' for k in _KEYS) + "}"
    reasoning = "Creativity: " + "1" * (MAX_REPLY_CHARS + 10)  # a 16k-digit "score" once took seconds to read
    assert parse_scores(early + reasoning + "\n" + _lines("6")).scores["Overall"] == 6.0
    assert not parse_scores(early + reasoning).ok  # the early dict lies beyond the part that is read
    assert parse_scores(early).scores["Overall"] == 9.0


def test_parse_na_counted_not_crashing():
    reply = "{'Creativity': 'N/A', 'Richness': 6, 'Visual Perception': 7, 'Logical Coherence': 8, 'Answer Accuracy': 6, 'Image Relationship Understanding': N/A, 'Overall Score': 6}"
    parsed = parse_scores(reply)
    assert parsed.ok and parsed.na == ["C", "IRU"] and parsed.scores["C"] is None and parsed.scores["R"] == 6


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "I cannot grade this.",
        '{"Creativity": 5, "Richness": 6}',  # incomplete
        '{"Creativity": 50, "Richness": 6, "Visual Perception": 7, "Logical Coherence": 8, "Answer Accuracy": 6, "Image Relationship Understanding": 5, "Overall Score": 6}',  # out of range
        "{'Creativity': __import__('os').system('echo pwned'), 'Overall Score': 1}",  # code is never run
    ],
)
def test_parse_rejects(reply, capfd):
    assert not parse_scores(reply).ok
    assert "pwned" not in capfd.readouterr().out


def test_aggregate_against_hand_computed_numbers():
    a = dict(FULL)
    b = {"C": 3.0, "R": 4.0, "VP": 5.0, "LC": 6.0, "AA": None, "IRU": 2.0, "Overall": 4.0}
    turns = [
        TurnScore("d1", 0, "ok", a),
        TurnScore("d1", 1, "ok", b, na=["AA"]),
        TurnScore("d2", 0, "unparsed"),
        TurnScore("d2", 1, "failed"),
    ]
    metrics, counts, meta = aggregate(turns)
    # all turns: (6 + 4 + 0 + 0) / 4 * 10 = 25 ; valid: (6 + 4) / 2 * 10 = 50
    assert metrics["Overall"] == pytest.approx(25.0) and metrics["valid/Overall"] == pytest.approx(50.0)
    # AA: all turns (6 + 0 + 0 + 0)/4*10 = 15; valid only turn a -> 60
    assert metrics["AA"] == pytest.approx(15.0) and metrics["valid/AA"] == pytest.approx(60.0)
    assert metrics["C"] == pytest.approx((5 + 3) / 4 * 10)
    assert counts == {"turns": 4, "dialogues": 2, "valid": 2, "unparsed": 1, "failed": 1, "missing": 0, "na": 1}
    assert meta["per_dialogue"]["d1"]["Overall"] == pytest.approx(50.0)
    assert meta["per_dialogue"]["d2"]["Overall"] == pytest.approx(0.0)
    assert meta["per_turn_index"]["0"]["Overall"] == pytest.approx(30.0)
    assert meta["per_turn_index"]["1"]["Overall"] == pytest.approx(20.0)
    assert meta["na_by_dimension"]["AA"] == 1


def _benchmark(tmp_path):
    records = [
        {"id": "d1", "image": ["/pics/a.png", "/pics/b.png"], "conversations": [
            {"from": "user", "value": "Image1: <ImageHere>. Image2: <ImageHere>. Compare them."},
            {"from": "assistant", "value": "REF one"},
            {"from": "user", "value": "And Image1 alone?"},
            {"from": "assistant", "value": "REF two"}]},
        {"id": "d2", "image": ["/pics/c.png"], "conversations": [
            {"from": "user", "value": "<ImageHere> What is it?"},
            {"from": "assistant", "value": "REF three"},
            {"from": "user", "value": "Sure?"},
            {"from": "assistant", "value": "REF four"}]},
    ]
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps(records))
    return load_mmdu_dialogues(path, image_root=str(tmp_path))


def test_score_mmdu_end_to_end_with_local_judge(tmp_path):
    from mmtune.evaluation.benchmarks.mmdu import score_mmdu

    dialogues = _benchmark(tmp_path)
    assert dialogues[0].images[1].path == str(tmp_path / "pics" / "b.png")
    predictions = {("d1", 0): TurnPrediction("ANS-A", {}), ("d1", 1): TurnPrediction("ANS-B", {}), ("d2", 0): TurnPrediction("ANS-C", {})}
    replies = {
        "ANS-A": Scripted('ok {"Creativity": 6, "Richness": 6, "Visual Perception": 6, "Logical Coherence": 6, "Answer Accuracy": 6, "Image Relationship Understanding": 6, "Overall Score": 8}'),
        "ANS-B": Scripted("no dict at all"),
        "ANS-C": Scripted("Creativity: 2\nRichness: 2\nVisual Perception: 2\nLogical Coherence: 2\nAnswer Accuracy: 2\nImage Relationship Understanding: N/A\nOverall Score: 4"),
    }

    def respond(body):
        prompt = body["messages"][-1]["content"]
        return next(v for k, v in replies.items() if f"[Assistant's Answer]\n{k}" in prompt)

    with FakeJudgeServer(respond) as server:
        judge = JudgeClient(JudgeConfig(model="judge-x", backoff_base_s=0.001), cache_path=tmp_path / "c.sqlite",
                            env={"MMTUNE_JUDGE_BASE_URL": server.base_url})
        result, turns = score_mmdu(dialogues, predictions, judge, MMDUConfig(), run="r", model="m")
        prompts = server.prompts()
    assert len(prompts) == 3
    first = next(p for p in prompts if "ANS-A" in p)
    assert "[Question]\nImage1: <image>. Image2: <image>. Compare them." in first and "[Reference Answer]\nREF one" in first
    # Overall: (8 + 0 + 4 + 0 missing) / 4 * 10 = 30; valid (8 + 4)/2*10 = 60
    assert result.metrics["Overall"] == pytest.approx(30.0) and result.metrics["valid/Overall"] == pytest.approx(60.0)
    assert result.metrics["IRU"] == pytest.approx(15.0) and result.metrics["valid/IRU"] == pytest.approx(60.0)
    assert result.counts["missing"] == 1 and result.counts["unparsed"] == 1 and result.counts["na"] == 1
    assert [t.status for t in turns] == ["ok", "unparsed", "ok", "missing"]
    # rows and the per-turn table number turns from 1 (predictions are keyed by position)
    assert [(t.dialogue_id, t.turn) for t in turns] == [("d1", 1), ("d1", 2), ("d2", 1), ("d2", 2)]
    assert sorted(result.meta["per_turn_index"]) == ["1", "2"]


def test_user_prompt_file_is_used_and_checked(tmp_path):
    from mmtune.evaluation.benchmarks.common import load_prompt

    good = tmp_path / "p.txt"
    good.write_text("Q={question} R={reference} A={answer} {\"Overall Score\": 1}")
    assert load_prompt("mmdu_judge.txt", str(good), ("question", "reference", "answer")).startswith("Q=")
    bad = tmp_path / "bad.txt"
    bad.write_text("Q={question}")
    with pytest.raises(ValueError, match=r"\{reference\}"):
        load_prompt("mmdu_judge.txt", str(bad), ("question", "reference", "answer"))


def test_placeholder_mismatch_is_reported_with_record_id(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps([{"id": "x7", "image": ["a.png"], "conversations": [{"from": "user", "value": "no image"}, {"from": "assistant", "value": "r"}]}]))
    with pytest.raises(ValueError, match=r"record 'x7' \(#0\): \[placeholder_mismatch\].*0 <ImageHere> placeholder\(s\), 1 image"):
        load_mmdu_dialogues(path)


@pytest.mark.parametrize("value", ["8.5e1", "1e308", "7E0", "1e-1", "8.5.1"])
def test_numbers_are_read_whole(value):
    """A value with an exponent is never cut to its leading digits (8.5e1 is not 8.5)."""
    others = "Creativity: 7\nRichness: 7\nVisual Perception: 7\nLogical Coherence: 7\nAnswer Accuracy: 7\nImage Relationship Understanding: 7\n"
    assert not parse_scores(others + f"Overall Score: {value}").ok
    as_json = '{"Creativity": 7, "Richness": 7, "Visual Perception": 7, "Logical Coherence": 7, "Answer Accuracy": 7, ' \
              f'"Image Relationship Understanding": 7, "Overall Score": "{value}"}}'
    assert not parse_scores(as_json).ok
    assert parse_scores(others + "Overall Score: 8.").scores["Overall"] == 8.0
