"""MDI-Benchmark: multiple choice by level, scenario and age group; Score_final with alpha.

The model answers with the template ``<Thought process>: <<...>> <Answer>: <<X>>``.
Option extraction (:func:`extract_option`) fixes the official pitfall, where a reply
without "Answer" that starts with a capital A-H ("A chart shows ...") is read as that
option. mmtune accepts, in order:

1. the template: ``<Answer>: <<X>>`` (last occurrence);
2. text after the last "answer" (``Answer: B``, ``the answer is (C)``) whose first token
   is a standalone letter (``A`` followed by a lower-case word is the article, not an option);
3. a reply that is only an option (``B``, ``(B)``, ``B.``) or starts with ``X.`` /
   ``X)`` / ``(X)`` / ``X:`` followed by text: "A chart ..." does not qualify;
4. a reply that equals one option's text (``"4"`` for ``D.4``).

A letter must be one of the item's options. When nothing qualifies, the item counts as
wrong and in ``counts["no_option"]`` (never guessed), and the per-item record keeps the
raw response so the case can be inspected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mmtune.evaluation.common import fill_prompt, load_json_or_jsonl, load_prompt
from mmtune.evaluation.results import BenchmarkResult

__all__ = ["MDIItem", "parse_options", "extract_option", "load_items", "build_prompt", "score_mdi"]

SCENARIOS = ("architecture", "education", "housework", "social_service", "sport", "transport")
AGES = ("young", "mid", "old")


@dataclass
class MDIItem:
    id: str
    level: int
    scenario: str
    age: str
    question: str
    options: dict[str, str]
    option_text: str
    answer: str
    image: Optional[str] = None
    response: Optional[str] = None


def parse_options(text: str) -> dict[str, str]:
    """``"A.1; B.2; C.3"`` -> ``{"A": "1", "B": "2", "C": "3"}``."""
    parts = re.split(r"(?:^|[;\n]\s*)([A-H])\s*[.:)]\s*", text.strip())
    options = {}
    for letter, body in zip(parts[1::2], parts[2::2]):
        options[letter] = body.strip().rstrip(";").strip()
    return options


def load_items(path: str, *, image_root: Optional[str] = None, limit: Optional[int] = None,
               allow_absolute_image_paths: bool = False) -> list[MDIItem]:
    """MDI-Benchmark items; ``image_path`` resolves under ``image_root`` (default: the file's
    folder) by the data layer's path rule, with ``.png`` added when it has no extension."""
    from pathlib import Path

    from mmtune.evaluation.common import resolve_image

    data = load_json_or_jsonl(path)
    if isinstance(data, dict):
        data = list(data.values())
    problems, items = [], []
    for index, record in enumerate(data):
        rid = str(record.get("question number", record.get("id", index)))
        key = str(record.get("key", ""))
        match = re.fullmatch(r"level([12])-(.+)-(old|mid|young)", key)
        if not match:
            problems.append(f"item {rid}: key {key!r} is not level{{1|2}}-<scenario>-<old|mid|young>")
            continue
        options = parse_options(str(record.get("option", "")))
        answer = str(record.get("answer", "")).strip().upper()
        if len(options) < 2:
            problems.append(f"item {rid}: could not read options from {record.get('option')!r}")
        if answer not in options:
            problems.append(f"item {rid}: answer {answer!r} is not one of the options {sorted(options)}")
        image = record.get("image_path")
        if image and not re.search(r"\.(png|jpe?g)$", image, re.IGNORECASE):
            image += ".png"
        if image:
            try:
                image = resolve_image(image, image_root, Path(path), allow_absolute=allow_absolute_image_paths)
            except ValueError as err:
                problems.append(f"item {rid}: [path_outside_root] {err}")
        items.append(
            MDIItem(rid, int(match.group(1)), match.group(2), match.group(3), str(record.get("question", "")),
                    options, str(record.get("option", "")), answer, image, record.get("response"))
        )
    if problems:
        raise ValueError(f"{path}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems[:20]))
    return items[:limit] if limit is not None else items


def build_prompt(item: MDIItem, template: Optional[str] = None) -> str:
    template = template or load_prompt("mdi_prompt.txt", None, ("question", "options"))
    return fill_prompt(template, question=item.question, options=item.option_text)


_TEMPLATE = re.compile(r"<\s*answer\s*>\s*[:：]?\s*<<\s*\(?([A-H])\)?\s*(?:[.:)]\s*[^>]*)?>>", re.IGNORECASE)
_AFTER_ANSWER = re.compile(r"answer", re.IGNORECASE)
_LEAD = re.compile(r"^[\s<>*:：\"'`\[]*(?:is\s+)?(?:option\s+)?\(?([A-H])\)?(?![A-Za-z0-9])")
_ONLY = re.compile(r"^[\s<>*\"'`\[(]*([A-H])[)\].:>*\"'`\s]*$")
_STARTS = re.compile(r"^\s*(?:\(([A-H])\)|([A-H])\s*[.:)])(?:\s|$)")


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def extract_option(response: Optional[str], options: dict[str, str]) -> tuple[Optional[str], str]:
    """(letter or None, which rule matched). See the module docstring for the rules."""
    if not response:
        return None, "empty"
    letters = set(options)
    for match in reversed(list(_TEMPLATE.finditer(response))):
        if match.group(1).upper() in letters:
            return match.group(1).upper(), "template"
    hits = list(_AFTER_ANSWER.finditer(response))
    if hits:
        tail = response[hits[-1].end():]
        match = _LEAD.match(tail)
        # "A" followed by a lower-case word is the article ("Answer: A chart shows ..."),
        # the same pitfall as at the start of a reply; other letters are not English words.
        article = match is not None and match.group(1) == "A" and re.match(r"\s+[a-z]", tail[match.end():])
        if match and match.group(1) in letters and not article:
            return match.group(1), "after-answer"
    match = _ONLY.match(response) or _STARTS.match(response)
    if match:
        letter = next(g for g in match.groups() if g)
        if letter in letters:
            return letter, "leading-option"
    normalized = _norm(response)
    same = [k for k, v in options.items() if normalized and _norm(v) == normalized]
    if len(same) == 1:
        return same[0], "option-text"
    return None, "none"


def score_mdi(
    items: Sequence[MDIItem],
    responses: dict[str, str],
    *,
    alpha: float = 0.5,
    run: str,
    model: str,
    context_length: Optional[int] = None,
) -> tuple[BenchmarkResult, list[dict[str, Any]]]:
    """Accuracy per level / scenario / age and Score_final = alpha*L1 + (1-alpha)*L2 (percent)."""
    records = []
    for item in items:
        response = responses.get(item.id)
        letter, rule = extract_option(response, item.options) if response is not None else (None, "missing")
        records.append(
            {"id": item.id, "level": item.level, "scenario": item.scenario, "age": item.age,
             "answer": item.answer, "extracted": letter, "rule": rule, "correct": letter == item.answer,
             "response": response}
        )

    def accuracy(group: list[dict[str, Any]]) -> float:
        return 100.0 * sum(r["correct"] for r in group) / len(group) if group else float("nan")

    metrics = {"accuracy": accuracy(records)}
    for level in (1, 2):
        metrics[f"level{level}"] = accuracy([r for r in records if r["level"] == level])
    metrics["score_final"] = alpha * metrics["level1"] + (1 - alpha) * metrics["level2"]
    for scenario in sorted({r["scenario"] for r in records}):
        metrics[f"scenario/{scenario}"] = accuracy([r for r in records if r["scenario"] == scenario])
        for level in (1, 2):
            group = [r for r in records if r["scenario"] == scenario and r["level"] == level]
            if group:
                metrics[f"scenario/{scenario}/level{level}"] = accuracy(group)
    for age in [a for a in AGES if any(r["age"] == a for r in records)]:
        metrics[f"age/{age}"] = accuracy([r for r in records if r["age"] == age])
    counts = {
        "items": len(records),
        "level1": sum(r["level"] == 1 for r in records),
        "level2": sum(r["level"] == 2 for r in records),
        "no_option": sum(r["rule"] == "none" for r in records),
        "missing": sum(r["rule"] == "missing" for r in records),
    }
    meta = {"alpha": alpha, "rules": {k: sum(r["rule"] == k for r in records) for k in sorted({r["rule"] for r in records})}}
    return BenchmarkResult(run, model, "mdi", metrics, counts, meta, context_length), records
