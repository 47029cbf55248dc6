"""Option extraction on a corpus of reply shapes seen from real models (our own wording).

Each case: the reply, the item's option letters, and the letter a careful reader takes
as the model's final choice (None: no choice is made - refusals, "cannot be determined",
hedges between letters, the article "A"). The official rule is run on the same corpus
and must agree with us wherever it reads a letter that the reply really chose.
"""

import re

import pytest

from mmtune.evaluation.benchmarks.mdi import extract_option, extract_option_official

ABCD = "ABCD"
CORPUS = [
    # --- the prompt's own template
    ("<Thought process>: <<There are two buses.>> <Answer>: <<B>>", ABCD, "B"),
    ("<Thought process>: <<Option A is tempting, but the sign says 30.>>\n<Answer>: <<C>>", ABCD, "C"),
    ("<Thought process>: <<...>> <Answer>: <<(D)>>", ABCD, "D"),
    ("<Thought process>: <<the stairs are steep>> <Answer>: <<A. stairs>>", ABCD, "A"),
    ("<Answer>: <<b>>", ABCD, "B"),
    ("<Thought process>: <<>>\n<Answer>:<<C>>", ABCD, "C"),
    # --- plain answer labels, several casings and spacings
    ("Answer: B", ABCD, "B"),
    ("answer: c", ABCD, "C"),
    ("ANSWER: D", ABCD, "D"),
    ("Answer:A", ABCD, "A"),
    ("Answer - B", ABCD, "B"),
    ("Answer = C", ABCD, "C"),
    ("The answer is B.", ABCD, "B"),
    ("So the answer is (C).", ABCD, "C"),
    ("Therefore, the correct answer is D: a bicycle.", ABCD, "D"),
    ("My final answer: A.", ABCD, "A"),
    ("Final answer: **C**", ABCD, "C"),
    ("The answer would be B because the bus is red.", ABCD, "B"),
    ("Answer: Option A.", ABCD, "A"),
    ("Answer: option D", ABCD, "D"),
    ("Answer: [B]", ABCD, "B"),
    ("Answer: \"C\"", ABCD, "C"),
    ("Answer: A because the ramp is the only step-free way in.", ABCD, "A"),
    ("The correct option is C.", ABCD, "C"),
    ("Correct choice: B", ABCD, "B"),
    # --- other labels
    ("<Option>: B.", ABCD, "B"),
    ("<Option>: <<D>>", ABCD, "D"),
    ("Option: C", ABCD, "C"),
    ("Choice: A", ABCD, "A"),
    ("Response: D", ABCD, "D"),
    # --- a letter, then an explanation that itself says "answer"
    ("Answer: D\nExplanation: the elderly person needs a handrail, so the answer must be D.", ABCD, "D"),
    ("Answer: B\n\nExplanation: To answer this we look at the timetable; the 8:15 train is the earliest.", ABCD, "B"),
    ("Answer: C. To answer this question, I counted the chairs around the table.", ABCD, "C"),
    # --- long chains of thought mentioning several letters before the verdict
    ("Let's check each option. A is a kitchen knife, which is dangerous. B is a plastic spoon. "
     "C is scissors. D is a lighter. The safest toy for a child is the spoon, so the answer is B.", ABCD, "B"),
    ("Step 1: the sign shows 40 km/h.\nStep 2: option A says 30, option B says 40.\nStep 3: B matches.\n\nFinal answer: B", ABCD, "B"),
    ("First, consider (A) - too far. Then (C) - closed on Sundays. (D) fits the schedule.\nAnswer: D", ABCD, "D"),
    ("Options A and C can be excluded. Between B and D, D is cheaper.\nTherefore the answer is D.", ABCD, "D"),
    ("I compared the prices of A, B, C and D.\n\n**Answer: C**", ABCD, "C"),
    ("Thinking: the child is about 8 years old... The answer could be A or B. After checking the height chart, the answer is B.", ABCD, "B"),
    # --- markdown and lists
    ("**Answer:** B", ABCD, "B"),
    ("### Answer\nC", ABCD, "C"),
    ("- Thought: the road is wet\n- Answer: A", ABCD, "A"),
    ("1. The man is holding a racket.\n2. Tennis needs a racket.\n\n**Final answer: (D)**", ABCD, "D"),
    ("`B`", ABCD, "B"),
    ("**C**", ABCD, "C"),
    ("The picture shows a crowded platform.\n\n**B**", ABCD, "B"),
    # --- a bare letter, or a letter leading the reply
    ("B", ABCD, "B"),
    ("(C)", ABCD, "C"),
    ("D.", ABCD, "D"),
    ("[A]", ABCD, "A"),
    ("C. The oven mitt protects the hand.", ABCD, "C"),
    ("B) a city bus", ABCD, "B"),
    ("(D) because it is the only accessible entrance.", ABCD, "D"),
    ("Option B: the stairs.", ABCD, "B"),
    ("A. Ramp", ABCD, "A"),
    ("B is correct because the light is red.", ABCD, "B"),
    ("A - the elevator", ABCD, "A"),
    # --- choice phrases without a label
    ("I would choose C, since it is closest to the door.", ABCD, "C"),
    ("I'd go with B.", ABCD, "B"),
    ("Option D is the most appropriate for an elderly person.", ABCD, "D"),
    ("Looking at the picture, option A seems correct.", ABCD, "A"),
    # --- other languages' punctuation and labels
    ("答案：B", ABCD, "B"),
    ("答案：（C）", ABCD, "C"),
    ("思考过程：图中有两辆车。\n答案：D", ABCD, "D"),
    ("回答：A", ABCD, "A"),
    ("Réponse : B", ABCD, "B"),
    ("La respuesta es C.", ABCD, "C"),
    ("Antwort: D", ABCD, "D"),
    ("【答案】B", ABCD, "B"),
    ("Answer：Ｃ", ABCD, "C"),
    ("「A」", ABCD, "A"),
    # --- five options
    ("Answer: E", "ABCDE", "E"),
    ("<Answer>: <<E>>", "ABCDE", "E"),
    # --- refusals and "cannot be determined", even with capitals or "Answer"
    ("I'm sorry, but I cannot determine the answer from this image.", ABCD, None),
    ("Cannot be determined from the picture.", ABCD, None),
    ("Answer: cannot be determined", ABCD, None),
    ("Answer: None of the options is correct.", ABCD, None),
    ("<Answer>: <<unknown>>", ABCD, None),
    ("The answer is not clear from the image.", ABCD, None),
    ("As an AI, I can't see the image clearly enough to answer.", ABCD, None),
    ("Based on the image, it is impossible to tell which option applies.", ABCD, None),
    ("Answer: N/A", ABCD, None),
    ("答案：无法确定", ABCD, None),
    # --- the article "A" is not option A
    ("A chart on the wall shows the count.", ABCD, None),
    ("A person is standing near the door.", ABCD, None),
    ("Answer: A detailed look at the image suggests it is a kitchen.", ABCD, None),
    ("A bus and a car are visible, but the question cannot be answered.", ABCD, None),
    # --- hedges between letters, letters that are not options
    ("Answer: B or C", ABCD, None),
    ("The answer is A and D.", ABCD, None),
    ("Answer: B/C", ABCD, None),
    ("Answer: E", ABCD, None),
    ("<Answer>: <<F>>", ABCD, None),
    # --- words that merely start with an option letter
    ("Because the bus is red.", ABCD, None),
    ("Definitely the second one.", ABCD, None),
    ("", ABCD, None),
]


def _options(letters: str) -> dict[str, str]:
    return {letter: f"text of {letter}" for letter in letters}


def test_corpus_is_large_and_varied():
    assert len(CORPUS) >= 80
    assert sum(expected is None for _, _, expected in CORPUS) >= 20  # refusals, articles, hedges
    assert len({(reply, letters) for reply, letters, _ in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize("reply, letters, expected", CORPUS, ids=[f"{i:03d}" for i in range(len(CORPUS))])
def test_corpus_reply(reply, letters, expected):
    letter, rule = extract_option(reply, _options(letters))
    assert letter == expected, f"read {letter!r} by rule {rule!r} from {reply!r}"


def _official_tail(reply: str) -> str:
    return re.sub(r"[<>:.]", "", reply.split("Answer")[-1]).strip()


def test_official_rule_agrees_wherever_it_reads_a_chosen_letter():
    """Where the official rule reads one of the item's letters, we read the same one, except
    where its letter is only the first letter of a word ("A chart", "ANSWER", "Cannot") or
    the reply hedges between letters ("B or C": we read no choice)."""
    agree = pitfalls = hedges = 0
    for reply, letters, expected in CORPUS:
        official = extract_option_official(reply)
        ours, rule = extract_option(reply, _options(letters))
        if official is None or official not in letters:
            continue
        tail = _official_tail(reply)
        if official == ours:
            agree += 1
        elif re.match(r"[A-Za-z]|\s+[a-z]", tail[1:]):  # a word's first letter, or the article "A"
            pitfalls += 1
        else:
            assert rule == "several", f"official {official!r} vs ours {ours!r} ({rule}) on {reply!r}"
            hedges += 1
    assert agree > 0 and pitfalls > 0 and hedges > 0


def corpus_figures() -> dict[str, int]:
    """Counts for the record: how each rule does on the corpus."""
    figures = {"cases": len(CORPUS), "ours_right": 0, "official_right": 0, "official_unreadable": 0,
               "official_wrong_letter": 0, "choices": sum(e is not None for _, _, e in CORPUS)}
    for reply, letters, expected in CORPUS:
        official = extract_option_official(reply)
        figures["ours_right"] += extract_option(reply, _options(letters))[0] == expected
        figures["official_right"] += official == expected
        figures["official_unreadable"] += official is None and expected is not None
        figures["official_wrong_letter"] += official is not None and official != expected
    return figures


def test_options_text_match():
    options = {"A": "walk", "B": "take the bus", "C": "drive"}
    assert extract_option("Take the bus.", options) == ("B", "option-text")
    assert extract_option("After looking at the timetable:\ntake the bus", options) == ("B", "option-text")
