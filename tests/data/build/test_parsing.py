import json

from mmtune.data.build.parsing import QA, parse_reply, renumber

GOOD = json.dumps({"qa": [{"question": "What is in Image1?", "answer": "A planet."},
                          {"question": "Compare Image1 and Image2.", "answer": "Both are round."}]})


def test_plain_json():
    p = parse_reply(GOOD, 2)
    assert p.pairs == [QA("What is in Image1?", "A planet."), QA("Compare Image1 and Image2.", "Both are round.")]
    assert not p.repairs and not p.dropped and p.error is None


def test_code_fence_and_surrounding_text_are_repaired():
    p = parse_reply("```json\n" + GOOD + "\n```", 2)
    assert len(p.pairs) == 2 and p.repairs == {"code_fence": 1}
    p = parse_reply("Sure! Here are the pairs:\n" + GOOD + "\nHope this helps.", 2)
    assert len(p.pairs) == 2 and p.repairs == {"extracted_json": 1}


def test_top_level_list_and_short_keys():
    p = parse_reply(json.dumps([{"q": "Why?", "a": "Because."}]), 1)
    assert p.pairs == [QA("Why?", "Because.")]


def test_question_answer_text_fallback():
    text = "Q1: What colour is it?\nA1: Red.\n\nQ2: Where?\nA2: In the sky,\nover the hill."
    p = parse_reply(text, 1)
    assert p.pairs == [QA("What colour is it?", "Red."), QA("Where?", "In the sky,\nover the hill.")]
    assert p.repairs == {"qa_text": 1}


def test_placeholders_removed_and_spacing_fixed():
    reply = json.dumps({"qa": [{"question": "<ImageHere> What is in Image 2?", "answer": "A <image> tower."}]})
    p = parse_reply(reply, 2)
    assert p.pairs == [QA("What is in Image2?", "A tower.")]
    assert p.repairs == {"placeholder_removed": 2, "reference_spacing": 1}


def test_bad_pairs_are_dropped_with_reasons():
    reply = json.dumps({"qa": [{"question": "Compare Image1 and Image4.", "answer": "x"},
                               {"question": "", "answer": "y"}, {"question": "ok?"}, "junk",
                               {"question": "Fine?", "answer": "Yes."}]})
    p = parse_reply(reply, 3)
    assert p.pairs == [QA("Fine?", "Yes.")]
    assert p.dropped == {"unknown_image_reference": 1, "empty_pair": 3}


def test_unparseable_reply_and_no_eval():
    assert parse_reply("I cannot help with that.", 1).error == "unparseable"
    # A Python literal is not JSON and is never evaluated.
    assert parse_reply("[{'question': __import__('os').getcwd(), 'answer': 1}]", 1).pairs == []


def test_renumber_moves_a_single_image_pair_to_its_place():
    assert renumber(QA("Is Image1 dark?", "Image1 is dark."), 3) == QA("Is Image3 dark?", "Image3 is dark.")
    assert renumber(QA("Q", "A"), 1) == QA("Q", "A")
