import json

import pytest

from mmtune.evaluation.benchmarks.mdi import build_prompt, extract_option, load_items, parse_options, score_mdi

OPTS = {"A": "1", "B": "2", "C": "3", "D": "4"}


def test_parse_options():
    assert parse_options("A.1; B.2; C.3; D.4") == OPTS
    # a missing separator before a letter still yields that option
    assert parse_options("A.1; B.2 C.3; D.4") == OPTS
    assert parse_options("A.1;B.2C.3;D.4") == OPTS
    assert parse_options("A: red car, B: a bus，C: a bike") == {"A": "red car", "B": "a bus", "C": "a bike"}
    assert parse_options("A. a red car; B. a bus; C. a bike") == {"A": "a red car", "B": "a bus", "C": "a bike"}


@pytest.mark.parametrize(
    "response, letter, rule",
    [
        ("<Thought process>: <<two cars>> <Answer>: <<B>>", "B", "template"),
        ("<Thought process>: <<Answer A is wrong>> <Answer>: <<C. 3>>", "C", "template"),
        ("I think it is two.\nAnswer: B", "B", "after-label"),
        ("The answer is (D).", "D", "after-label"),
        ("B", "B", "only-option"),
        ("(C)", "C", "only-option"),
        ("D. Because four people stand there.", "D", "leading-option"),
        ("3", "C", "option-text"),
        # the official pitfall: a sentence that starts with the article "A" is not option A
        ("A chart on the wall shows the count.", None, "none"),
        ("A person is standing near the door", None, "none"),
        ("Answer: A chart shows it", None, "none"),
        ("<Answer>: <<E>>", None, "none"),  # not an option of this item
        ("", None, "empty"),
    ],
)
def test_extract_option(response, letter, rule):
    assert extract_option(response, OPTS) == (letter, rule)


def test_score_final_and_breakdowns(tmp_path):
    items = [
        {"question number": 1, "key": "level1-sport-old", "image_path": "img/1", "question": "q", "option": "A.1; B.2", "answer": "A", "response": "<Answer>: <<A>>"},
        {"question number": 2, "key": "level1-sport-young", "image_path": "img/2", "question": "q", "option": "A.1; B.2", "answer": "B", "response": "A chart"},
        {"question number": 3, "key": "level2-housework-old", "image_path": "img/3", "question": "q", "option": "A.1; B.2; C.3", "answer": "C", "response": "Answer: C"},
        {"question number": 4, "key": "level2-sport-mid", "image_path": "img/4", "question": "q", "option": "A.1; B.2", "answer": "B", "response": "B"},
        {"question number": 5, "key": "level2-sport-mid", "image_path": "img/5", "question": "q", "option": "A.1; B.2", "answer": "B", "response": "A"},
    ]
    path = tmp_path / "mdi.json"
    path.write_text(json.dumps(items))
    loaded = load_items(str(path), image_root="/data")
    assert loaded[0].image == "/data/img/1.png"
    result, records = score_mdi(loaded, {i.id: i.response for i in loaded}, alpha=0.25, run="r", model="m")
    m = result.metrics
    # L1: 1/2 = 50; L2: 2/3 = 66.67; final = 0.25*50 + 0.75*66.67 = 62.5
    assert m["level1"] == pytest.approx(50.0) and m["level2"] == pytest.approx(200 / 3)
    assert m["score_final"] == pytest.approx(0.25 * 50 + 0.75 * 200 / 3)
    assert m["scenario/sport"] == pytest.approx(50.0) and m["scenario/housework"] == pytest.approx(100.0)
    assert m["age/old"] == pytest.approx(100.0) and m["age/young"] == 0.0 and m["age/mid"] == pytest.approx(50.0)
    assert result.counts["unreadable"] == 1  # "A chart"
    # the official rule reads "A chart" as A: item 2 stays wrong (answer B), so only the unreadable count differs
    assert result.counts["official_unreadable"] == 0 and result.counts["rules_disagree"] == 1
    assert m["official/score_final"] == pytest.approx(m["score_final"])
    assert "<Answer>: <<option letter>>" in build_prompt(loaded[0]) and "A.1; B.2" in build_prompt(loaded[0])


def test_bad_items_reported_together(tmp_path):
    path = tmp_path / "mdi.json"
    path.write_text(json.dumps([
        {"question number": 1, "key": "level3-sport-old", "option": "A.1; B.2", "answer": "A"},
        {"question number": 2, "key": "level1-sport-old", "option": "A.1; B.2", "answer": "E"},
    ]))
    with pytest.raises(ValueError) as err:
        load_items(str(path))
    assert "record '1' (#0): [malformed_record]" in str(err.value) and "key 'level3-sport-old'" in str(err.value)
    assert "record '2' (#1): [malformed_record]" in str(err.value) and "answer 'E'" in str(err.value)


def test_item_whose_answer_follows_no_separator_loads(tmp_path):
    path = tmp_path / "mdi.json"
    path.write_text(json.dumps([
        {"question number": 7, "key": "level2-transport-young", "image_path": "x", "question": "q",
         "option": "A.walk; B.bus C.train; D.car", "answer": "C", "response": "Answer: C"},
    ]))
    (item,) = load_items(str(path))
    assert item.options == {"A": "walk", "B": "bus", "C": "train", "D": "car"} and item.answer == "C"


def test_report_shows_official_and_ours_side_by_side(tmp_path):
    from mmtune.evaluation.benchmarks.registry import benchmarks_for
    from mmtune.evaluation.reporting.report import write_report

    path = tmp_path / "mdi.json"
    path.write_text(json.dumps([
        {"question number": 1, "key": "level1-sport-old", "option": "A.1; B.2", "answer": "B", "response": "ANSWER: B"},
        {"question number": 2, "key": "level2-sport-old", "option": "A.1; B.2", "answer": "A", "response": "A"},
    ]))
    items = load_items(str(path))
    result, _ = score_mdi(items, {i.id: i.response for i in items}, run="r", model="m")
    # the official rule reads "ANSWER: B" as A (no "Answer" in it, starts with a capital A)
    assert result.metrics["score_final"] == 100.0 and result.metrics["official/score_final"] == 50.0
    text = write_report([result], tmp_path, sections=benchmarks_for(["mdi"]))[0].read_text()
    assert "| extraction | score_final | level1 | level2 | accuracy | unreadable |" in text
    assert "| mmtune | 100.0 | 100.0 | 100.0 | 100.0 | 0 |" in text
    assert "| official rule | 50.0 | 0.0 | 100.0 | 50.0 | 0 |" in text


def test_a_reply_longer_than_the_cap_reads_no_option():
    from mmtune.evaluation.benchmarks.mdi import MAX_RESPONSE_CHARS

    options = {"A": "1", "B": "2", "C": "3"}
    assert extract_option("Answer: B", options) == ("B", "after-label")
    long = "answer " * (MAX_RESPONSE_CHARS // 7 + 1) + "Answer: B"
    assert len(long) > MAX_RESPONSE_CHARS and extract_option(long, options) == (None, "too-long")
    # many labels below the cap: each is read in place (no copy of the rest per label), same letter
    assert extract_option("answer answer " * 2000 + "Answer: C", options) == ("C", "after-label")
