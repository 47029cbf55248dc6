"""MDI-Benchmark: multiple choice by level, scenario and age group; Score_final with alpha.

The model answers with the template ``<Thought process>: <<...>> <Answer>: <<X>>``, but
real replies come in many shapes (chains of thought, markdown, lists, other labels and
languages, full-width punctuation). :func:`extract_option` reads the same letter as the
official rule wherever that rule reads a real choice, recovers clear answers it misses,
and reads nothing from refusals, "cannot be determined" replies and "B or C" hedges;
it fixes the official pitfall where a reply that starts with a capital A-H ("A chart
shows ...") is read as that option. :func:`extract_option_official` is the official rule
itself: both scores are reported side by side, with each rule's unreadable count.

An item whose reply yields no letter counts as wrong (never guessed); the per-item
record keeps the raw response and both readings so the case can be inspected.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.evaluation.benchmarks.base import Benchmark, BenchmarkWork, RunContext, count_image_items
from mmtune.evaluation.benchmarks.common import fill_prompt, load_prompt
from mmtune.evaluation.benchmarks.registry import register
from mmtune.evaluation.results import BenchmarkResult

__all__ = ["MDIConfig", "MDIItem", "parse_options", "extract_option", "extract_option_official", "load_items", "build_prompt",
           "score_mdi", "MDIBenchmark"]


@dataclass
class MDIConfig:
    data_path: Optional[str] = None
    """MDI-Benchmark items (JSON list or JSONL)."""
    image_root: Optional[str] = None
    """Directory of the png images (``image_path`` has no extension)."""
    predictions: Optional[str] = None
    """Items with a ``response`` field to score instead of generating."""
    alpha: float = 0.5
    """Score_final = alpha * level-1 accuracy + (1 - alpha) * level-2 accuracy."""
    limit: Optional[int] = None
    """Evaluate only the first N items."""

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
    image_root: Optional[str] = field(default=None, compare=False)
    """The real image root ``image`` lies in (it is opened only inside it); ``None``: not confined."""


_OPTION_MARK = r"\s*[.:)：．、]"


def parse_options(text: str) -> dict[str, str]:
    """``"A.1; B.2; C.3"`` -> ``{"A": "1", "B": "2", "C": "3"}``.

    Letters are found in order (A, then B, ...). A letter is preferably one that follows a
    separator (start, ``;``, ``,``, newline or a space); when none does, any ``B.`` after
    ``A``'s text is taken, so ``"A.1; B.2 C.3;D.4"`` and ``"A.1B.2"`` still give every option.
    """
    text = text.strip()
    marks: list[tuple[str, int, int]] = []
    position = 0
    for letter in "ABCDEFGH":
        preferred = re.compile(rf"(?:^|(?<=[;,，；\n\s]))\(?{letter}{_OPTION_MARK}")
        found = preferred.search(text, position) or re.compile(rf"\(?{letter}{_OPTION_MARK}").search(text, position)
        if found is None:
            break
        marks.append((letter, found.start(), found.end()))
        position = found.end()
    options = {}
    for k, (letter, _, end) in enumerate(marks):
        stop = marks[k + 1][1] if k + 1 < len(marks) else len(text)
        options[letter] = text[end:stop].strip().rstrip(";,，；").strip()
    return options


def load_items(path: str, *, image_root: Optional[str] = None, limit: Optional[int] = None,
               allow_absolute_image_paths: bool = False, check_images: str = "none",
               image_limits: Any = None) -> list[MDIItem]:
    """MDI-Benchmark items (a JSON list, JSON lines or an object of items).

    ``image_path`` resolves under ``image_root`` (default: the file's folder) by the data
    layer's path rule, with ``.png`` added when it has no extension; ``check_images="verify"``
    also opens each file's header (exists, is an image, within ``image_limits``). Read as
    strictly as training data: an item that is no object, two items with one id, a lone
    surrogate, a bad key, options or answer, a bad image path: every problem is listed
    with the item and the file is refused.

    Raises:
        BenchmarkDataError: listing the problems.
    """
    from mmtune.data.validation import ImageChecker, Problem
    from mmtune.evaluation.benchmarks.common import checked_item_image, read_records, refuse

    records, problems = read_records(path)
    checker = ImageChecker(check_images, image_limits)
    items, seen = [], set()
    for index, (_, record) in enumerate(records):
        if not isinstance(record, dict):
            problems.append(Problem("malformed_record", f"#{index}", index, None,
                                    f"a JSON {type(record).__name__}, not an object"))
            continue
        rid = str(record.get("question number", record.get("id", index)))

        def bad(detail: str, code: str = "malformed_record") -> None:
            problems.append(Problem(code, rid, index, None, detail))

        if rid in seen:
            bad("id seen earlier (question number / id)", "duplicate_id")
        seen.add(rid)
        key = str(record.get("key", ""))
        match = re.fullmatch(r"level([12])-(.+)-(old|mid|young)", key)
        if not match:
            bad(f"key {key!r} is not level{{1|2}}-<scenario>-<old|mid|young>")
            continue
        options = parse_options(str(record.get("option", "")))
        answer = str(record.get("answer", "")).strip().upper()
        if len(options) < 2:
            bad(f"could not read options from {record.get('option')!r}")
        if answer not in options:
            bad(f"answer {answer!r} is not one of the options {sorted(options)}")
        image = record.get("image_path")
        if image is not None and not isinstance(image, str):
            bad(f"image_path must be a file path, not a JSON {type(image).__name__}")
            continue
        if image and not re.search(r"\.(png|jpe?g)$", image, re.IGNORECASE):
            image += ".png"
        if image:
            image, root, found = checked_item_image(image, image_root, Path(path), checker,
                                              allow_absolute=allow_absolute_image_paths)
            for detail, code in found:
                bad(detail, code)
            if image is None:
                continue
        response = record.get("response")
        if response is not None and not isinstance(response, str):
            bad(f"response must be text, not a JSON {type(response).__name__}")
        items.append(
            MDIItem(rid, int(match.group(1)), match.group(2), match.group(3), str(record.get("question", "")),
                    options, str(record.get("option", "")), answer, image, response, root if image else None)
        )
    refuse(path, problems, "MDI-Benchmark file")
    return items[:limit] if limit is not None else items


def build_prompt(item: MDIItem, template: Optional[str] = None) -> str:
    template = template or load_prompt("mdi_prompt.txt", None, ("question", "options"))
    return fill_prompt(template, question=item.question, options=item.option_text)


def extract_option_official(response: Optional[str]) -> Optional[str]:
    """The official rule (the MDI-Benchmark evaluation script): text after the last ``Answer``, ``<>:.`` removed,
    its first character when it is a letter A-H. Kept to report the official score
    beside ours; it reads "A chart shows ..." as option A."""
    if not response:
        return None
    tail = re.sub(r"[<>:.]", "", response.split("Answer")[-1]).strip()
    return tail[0] if tail and tail[0] in "ABCDEFGH" else None


_TRANSLATE = str.maketrans({"【": "[", "】": "]", "「": '"', "」": '"', "『": '"', "』": '"', "《": "<", "》": ">",
                           "“": '"', "”": '"', "‘": "'", "’": "'", "、": ",", "。": ".", "→": "->"})
#: words that may follow an option letter ("B is correct", "A because ..."); any other
#: lower-case word after "A" makes it the article ("A chart shows ...")
_CONNECTORS = {"is", "was", "because", "since", "as", "and", "which", "seems", "appears", "would", "should",
               "fits", "matches", "best", "correctly", "here", "so", "but", "then", "from", "in", "with", "for"}
# Whitespace runs are possessive (\s*+) where what follows cannot be whitespace, so that no
# reply makes a pattern backtrack over a long run: every rule is linear in the reply.
_TEMPLATE = re.compile(r"<\s*+answer\s*+>\s*+:?\s*+<<\s*+\(?\s*+([A-Ha-h])\s*+\)?\s*+(?:[.:)][^>]*+)?>>",
                       re.IGNORECASE)
_LABEL = re.compile(
    r"(?:\b(?:final|correct|right|best|my|the)\s+)?"
    r"(?:\banswers?\b|\bresponse\b|\bsolution\b|答案|回答|答|\bréponse\b|\brespuesta\b|\bantwort\b|\brisposta\b|\bresposta\b|ответ)"
    r"|<\s*(?:option|choice)\s*>|\b(?:correct|right|best|final)\s+(?:option|choice)\b|\b(?:option|choice)\s*:",
    re.IGNORECASE,
)
_PREFIX = re.compile(
    r"(?:[\s>\]\)\*\"'`:=\-–—.,]|->|<|\[|\(|"
    r"\b(?:is|was|would|should|must|will|be|then|therefore|thus|so|here|clearly|definitely|likely|probably|"
    r"option|choice|letter|number|c'est|la|es|ist|il|est)\b)*",
    re.IGNORECASE,
)
_REFUSAL_TAIL = re.compile(
    r"(?:not\b|cannot\b|can't\b|can\s+not\b|unable\b|unknown\b|unclear\b|none\b|n/?a\b|impossible\b|"
    r"undetermin|indetermin|insufficient\b|ambiguous\b|no\s+(?:option|answer|choice|correct)|无法|不能|不确定)",
    re.IGNORECASE,
)
_LETTER = re.compile(r"\(?\s*+([A-Ha-h])(?![A-Za-z0-9'’])")
_SECOND = re.compile(r"\s*+\)?\s*+(?:,|/|&|\band\b|\bor\b)\s*+\(?(?:option\s+)?[A-H](?![A-Za-z0-9])", re.IGNORECASE)
_NEXT_WORD = re.compile(r"\s+([a-z]+)")
_CHOOSE = re.compile(
    r"(?:\b(?:option|choice)\s*\(?([A-H])\)?\s+(?:is|seems|appears)\s+(?:to\s+be\s+)?(?:the\s+)?(?:most\s+)?"
    r"(?:correct|right|best|accurate|appropriate|answer))"
    r"|(?:\b(?:i\s+(?:would\s+|will\s+)?(?:choose|select|pick)|i'd\s+(?:choose|select|pick|go\s+with)|go\s+with|"
    r"i\s+(?:will\s+)?go\s+with)\s+(?:option\s+)?\(?([A-H])\)?(?![A-Za-z0-9]))",
    re.IGNORECASE,
)
_ONLY = re.compile(r"^[\s<>\"'`\[(]*(?:option\s+)?([A-H])[)\].:>\"'`\s]*$", re.IGNORECASE)
_STARTS = re.compile(
    r"^\s*+[\[(<\"']*+\s*+(?:option\s+)?([A-H])\s*+(?:[.:)\]>,]|(?<=\s)[-–—]|(?<=\s)(?=(?:is|was|because|since|seems|fits)\b)|$)",
    re.IGNORECASE,
)
MAX_RESPONSE_CHARS = 65_536
"""Longest reply :func:`extract_option` reads (512 new tokens are about 2k characters);
a longer one reads as no option (rule ``too-long``)."""


def _clean(text: str) -> str:
    """Full-width forms to ASCII (NFKC), CJK brackets and quotes to ASCII, markdown emphasis dropped."""
    text = unicodedata.normalize("NFKC", text).translate(_TRANSLATE)
    return re.sub(r"\*\*|__|`|^#+\s*", "", text, flags=re.MULTILINE)


def _letter_after(text: str, pos: int, letters: set[str]) -> tuple[Optional[str], str]:
    """(letter, "") or (None, why) for the text that follows an answer label at ``text[pos]``
    (read in place: a reply with many labels is never copied once per label)."""
    pos = _PREFIX.match(text, pos).end()
    if _REFUSAL_TAIL.match(text, pos):
        return None, "refusal"
    match = _LETTER.match(text, pos)
    if not match:
        return None, "no-letter"
    letter, rest = match.group(1), match.end()
    if letter.islower() or letter == "A":
        word = _NEXT_WORD.match(text, rest)
        if word and word.group(1) not in _CONNECTORS:
            return None, "article"  # "A chart shows ...", "a bit unclear"
    if letter.upper() not in letters:
        return None, "not-an-option"
    if _SECOND.match(text, rest):
        return None, "several"  # "B or C", "A and D": no single choice
    return letter.upper(), ""


def extract_option(response: Optional[str], options: dict[str, str]) -> tuple[Optional[str], str]:
    """(letter or None, which rule matched), in this order:

    1. the template ``<Answer>: <<X>>`` (last occurrence);
    2. the last answer label (``Answer:``, ``the final answer is``, ``<Option>:``, ``答案：``,
       ``Réponse :`` ...) followed by a standalone letter; earlier labels are tried when the
       last one is followed by no letter ("... to answer this, ..."), while a label followed by
       a refusal ("Answer: cannot be determined") reads nothing;
    3. "option X is correct", "I choose X";
    4. a reply that starts with an option (``B``, ``(B)``, ``B.``, ``Option B:``) or whose last
       line is only an option; "A chart ..." is the article, not option A;
    5. a reply (or its last line) that equals one option's text.

    Letters must be among the item's options; "B or C" reads nothing. A reply longer than
    :data:`MAX_RESPONSE_CHARS` reads nothing (``too-long``).
    """
    if not response or not response.strip():
        return None, "empty"
    if len(response) > MAX_RESPONSE_CHARS:
        return None, "too-long"
    letters = set(options)
    text = _clean(response)
    for match in reversed(list(_TEMPLATE.finditer(text))):
        if match.group(1).upper() in letters:
            return match.group(1).upper(), "template"
    for match in reversed(list(_LABEL.finditer(text))):
        letter, why = _letter_after(text, match.end(), letters)
        if letter:
            return letter, "after-label"
        if why in ("refusal", "several"):
            return None, why
    chosen = [m for m in _CHOOSE.finditer(text) if (m.group(1) or m.group(2)).upper() in letters]
    if chosen:
        return (chosen[-1].group(1) or chosen[-1].group(2)).upper(), "choice-phrase"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for candidate in (text.strip(), lines[-1] if lines else ""):
        match = _ONLY.match(candidate)
        if match and match.group(1).upper() in letters:
            return match.group(1).upper(), "only-option"
    match = _STARTS.match(text)
    if match and match.group(1) in letters:
        if not _SECOND.match(text, match.end()):
            return match.group(1), "leading-option"
    for candidate in (text, lines[-1] if lines else ""):
        normalized = _norm(candidate)
        same = [k for k, v in options.items() if normalized and _norm(v) == normalized]
        if len(same) == 1:
            return same[0], "option-text"
    return None, "none"


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def score_mdi(
    items: Sequence[MDIItem],
    responses: dict[str, str],
    *,
    alpha: float = 0.5,
    run: str,
    model: str,
    context_length: Optional[int] = None,
) -> tuple[BenchmarkResult, list[dict[str, Any]]]:
    """Accuracy per level / scenario / age and Score_final = alpha*L1 + (1-alpha)*L2 (percent).

    The same figures under the official extraction rule are reported beside ours
    (``official/score_final``, ...), with how many replies each rule could not read
    (``counts["unreadable"]``, ``counts["official_unreadable"]``).
    """
    records = []
    for item in items:
        response = responses.get(item.id)
        letter, rule = extract_option(response, item.options) if response is not None else (None, "missing")
        official = extract_option_official(response)
        records.append(
            {"id": item.id, "level": item.level, "scenario": item.scenario, "age": item.age,
             "answer": item.answer, "extracted": letter, "rule": rule, "correct": letter == item.answer,
             "official_extracted": official, "official_correct": official == item.answer, "response": response}
        )

    def accuracy(group: list[dict[str, Any]], key: str = "correct") -> float:
        return 100.0 * sum(r[key] for r in group) / len(group) if group else float("nan")

    metrics: dict[str, float] = {}
    for prefix, key in (("", "correct"), ("official/", "official_correct")):
        metrics[f"{prefix}accuracy"] = accuracy(records, key)
        for level in (1, 2):
            metrics[f"{prefix}level{level}"] = accuracy([r for r in records if r["level"] == level], key)
        metrics[f"{prefix}score_final"] = alpha * metrics[f"{prefix}level1"] + (1 - alpha) * metrics[f"{prefix}level2"]
    for scenario in sorted({r["scenario"] for r in records}):
        metrics[f"scenario/{scenario}"] = accuracy([r for r in records if r["scenario"] == scenario])
        for level in (1, 2):
            group = [r for r in records if r["scenario"] == scenario and r["level"] == level]
            if group:
                metrics[f"scenario/{scenario}/level{level}"] = accuracy(group)
    for age in [a for a in AGES if any(r["age"] == a for r in records)]:
        metrics[f"age/{age}"] = accuracy([r for r in records if r["age"] == age])
    answered = [r for r in records if r["rule"] != "missing"]
    counts = {
        "items": len(records),
        "level1": sum(r["level"] == 1 for r in records),
        "level2": sum(r["level"] == 2 for r in records),
        "unreadable": sum(r["extracted"] is None for r in answered),
        "official_unreadable": sum(r["official_extracted"] is None for r in answered),
        "rules_disagree": sum(r["extracted"] != r["official_extracted"] for r in answered),
        "missing": len(records) - len(answered),
    }
    meta = {"alpha": alpha, "rules": {k: sum(r["rule"] == k for r in records) for k in sorted({r["rule"] for r in records})}}
    return BenchmarkResult(run, model, "mdi", metrics, counts, meta, context_length), records


@register
class MDIBenchmark(Benchmark):
    """MDI-Benchmark: multiple choice, no judge; our option extraction and the official one side by side."""

    name = "mdi"
    settings_class = MDIConfig

    def check(self, cfg: Any) -> list[str]:
        sub = cfg.mdi
        problems = [] if (sub.data_path or sub.predictions) else ["eval.mdi: set data_path (to generate) or predictions (items with a 'response')"]
        if not 0.0 <= sub.alpha <= 1.0:
            problems.append(f"eval.mdi.alpha={sub.alpha}: must be within [0, 1]")
        return problems

    def load(self, sub: Any, ctx: RunContext) -> list[MDIItem]:
        return load_items(sub.predictions or sub.data_path, image_root=sub.image_root, limit=sub.limit,
                          allow_absolute_image_paths=ctx.cfg.allow_absolute_image_paths,
                          check_images=self.image_checks(sub, ctx), image_limits=ctx.image_limits)

    def dialogues(self, items, sub):
        from mmtune.data.dialogue import Dialogue, Image, Turn

        # the generator answers (user, assistant) exchanges: the reference slot stays empty
        return [Dialogue(i.id, "mdi", (Turn("user", ((Image(i.image, i.image_root), "\n") if i.image else ()) + (build_prompt(i),)),
                                       Turn("assistant", ("",))))
                for i in items]

    def load_predictions(self, path, items, sub):
        missing = [i.id for i in items if i.response is None]
        if missing:
            raise ValueError(f"{path}: items {missing[:10]} have no 'response' field")
        return {i.id: i.response for i in items}

    def from_generations(self, records, items):
        return {r.dialogue_id: r.answer for r in records if r.answer is not None}

    def score(self, items, predictions, ctx, sub):
        return score_mdi(items, predictions, alpha=sub.alpha, run=ctx.run, model=ctx.model, context_length=ctx.context_length)

    def count_items(self, sub: Any, cache_dir: Optional[str], problems: list[str]) -> BenchmarkWork:
        """One answer per item, no judge; images are ``image_path`` (``.png`` added) under ``image_root``."""

        def image_of(item: dict) -> str:
            image = str(item.get("image_path", ""))
            return image if image.endswith(".png") else image + ".png"

        return count_image_items(self, sub, problems, image_of, 0)

    viewer_scale = "% correct"

    def viewer_entries(self, sub: Any, out: Path, *, allow_absolute_image_paths: bool = False) -> Optional[list[Any]]:
        """One entry per scored item: the reply, the option read from it and by which rule."""
        from mmtune.evaluation.reporting.viewer import ViewerEntry, read_jsonl

        items = {i.id: i for i in load_items(sub.predictions or sub.data_path, image_root=sub.image_root,
                                             limit=sub.limit, allow_absolute_image_paths=allow_absolute_image_paths)}
        entries = []
        for row in read_jsonl(out / "details" / "mdi.jsonl"):
            item = items.get(str(row["id"]))
            question = (item.question + "\n" + item.option_text) if item else ""
            turn = {"question": question.strip(), "images": [item.image] if item and item.image else [],
                    "answer": row.get("response"), "reference": row.get("answer"),
                    "scores": {"correct": 1.0 if row.get("correct") else 0.0},
                    "status": f"extracted {row.get('extracted')!s} ({row.get('rule')})", "rationale": ""}
            entries.append(ViewerEntry(str(row["id"]), 100.0 if row.get("correct") else 0.0, [turn],
                                       {"level": f"level{row.get('level')}", "scenario": row.get("scenario"),
                                        "age": row.get("age")}))
        return entries

    def report_section(self, result: BenchmarkResult, out: Path) -> tuple[list[str], list[Path]]:
        from mmtune.evaluation.reporting.plots import plot_bars
        from mmtune.evaluation.reporting.report import markdown_table

        m, c = result.metrics, result.counts
        keys = ["score_final", "level1", "level2", "accuracy"]
        lines = [markdown_table(["extraction", *keys, "unreadable"],
                                [["mmtune", *[m[k] for k in keys], c.get("unreadable", "")],
                                 ["official rule", *[m.get(f"official/{k}", float("nan")) for k in keys], c.get("official_unreadable", "")]])]
        groups = sorted(k for k in m if k.count("/") == 1 and not k.startswith("official/"))
        lines += ["", markdown_table(["group", "accuracy"], [[k, m[k]] for k in groups])]
        plots = [plot_bars(out / "mdi_groups.png", "MDI accuracy", {"accuracy": {k: m[k] for k in groups}}, "accuracy (%)")]
        return lines, plots
