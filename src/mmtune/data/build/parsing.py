"""Parsing teacher replies into Q&A pairs, without ``eval``.

A reply should be ``{"qa": [{"question", "answer"}, ...]}``. Real teachers wrap it in
code fences, add a sentence before it, or fall back to "Q: ... A: ..." text; those are
repaired because the intent is unambiguous, and every repair is counted by name.
Pairs that cannot be trusted are dropped with a reason:

- ``empty_pair``: a question or answer is missing or blank.
- ``unknown_image_reference``: ``ImageN`` names an image the set does not have.

Repairs (the pair is kept):

- ``code_fence`` / ``extracted_json`` / ``qa_text``: how the JSON or pairs were found.
- ``placeholder_removed``: the teacher wrote an image placeholder; images are placed
  by the builder, so the literal is removed.
- ``reference_spacing``: ``Image 2`` written as ``Image2``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

PLACEHOLDER_RE = re.compile(r"<\s*(?:ImageHere|image)\s*>", re.IGNORECASE)
REFERENCE_RE = re.compile(r"\bImage\s*(\d+)\b")
_FENCE_RE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```\s*$", re.DOTALL)
_QA_TEXT_RE = re.compile(
    r"(?:^|\n)\s*(?:\*\*)?(?:Q|Question)\s*\d*\s*(?:\*\*)?\s*[:.)]\s*(.+?)\n\s*(?:\*\*)?(?:A|Answer)\s*\d*\s*(?:\*\*)?\s*[:.)]\s*(.+?)"
    r"(?=\n\s*(?:\*\*)?(?:Q|Question)\s*\d*\s*(?:\*\*)?\s*[:.)]|\Z)",
    re.DOTALL,
)
_LIST_KEYS = ("qa", "pairs", "conversations", "questions", "qa_pairs")
_Q_KEYS = ("question", "q", "Q", "Question")
_A_KEYS = ("answer", "a", "A", "Answer")


@dataclass(frozen=True)
class QA:
    question: str
    answer: str


@dataclass
class Parsed:
    """Pairs found in one reply, with repairs applied and drops counted."""

    pairs: list[QA] = field(default_factory=list)
    repairs: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    error: Optional[str] = None
    """Why nothing could be parsed (``unparseable``); ``None`` when the reply had structure."""


def _load_json(text: str, parsed: Parsed) -> Any:
    m = _FENCE_RE.match(text)
    if m:
        text = m.group(1).strip()
        parsed.repairs["code_fence"] += 1
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        return None
    start = min(starts)
    end = text.rfind("}" if text[start] == "{" else "]")
    if end <= start:
        return None
    try:
        data = json.loads(text[start : end + 1])
    except json.JSONDecodeError:
        return None
    parsed.repairs["extracted_json"] += 1
    return data


def _items(data: Any) -> Optional[list]:
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        for key in _LIST_KEYS:
            if isinstance(data.get(key), list):
                return data[key]
        if any(k in data for k in _Q_KEYS):
            return [data]
    return None


def _field(item: dict, keys: tuple[str, ...]) -> Optional[str]:
    for k in keys:
        v = item.get(k)
        if isinstance(v, str):
            return v
    return None


def _clean(text: str, n_images: int, parsed: Parsed) -> tuple[str, Optional[str]]:
    if PLACEHOLDER_RE.search(text):
        text = PLACEHOLDER_RE.sub("", text)
        text = re.sub(r"[ \t]{2,}", " ", text)
        parsed.repairs["placeholder_removed"] += 1
    if re.search(r"\bImage\s+\d+\b", text):
        text = re.sub(r"\bImage\s+(\d+)\b", r"Image\1", text)
        parsed.repairs["reference_spacing"] += 1
    for m in REFERENCE_RE.finditer(text):
        k = int(m.group(1))
        if k < 1 or k > n_images:
            return text.strip(), f"Image{k} of a {n_images}-image set"
    return text.strip(), None


def parse_reply(reply: str, n_images: int) -> Parsed:
    """Q&A pairs of one teacher reply about ``n_images`` images (``ImageN`` must be in 1..n)."""
    parsed = Parsed()
    text = (reply or "").strip()
    data = _load_json(text, parsed)
    items = _items(data) if data is not None else None
    if items is None:
        found = _QA_TEXT_RE.findall(text)
        if not found:
            parsed.error = "unparseable"
            return parsed
        parsed.repairs["qa_text"] += 1
        items = [{"question": q, "answer": a} for q, a in found]
    for item in items:
        q = _field(item, _Q_KEYS) if isinstance(item, dict) else None
        a = _field(item, _A_KEYS) if isinstance(item, dict) else None
        if not q or not q.strip() or not a or not a.strip():
            parsed.dropped["empty_pair"] += 1
            continue
        q, bad_q = _clean(q, n_images, parsed)
        a, bad_a = _clean(a, n_images, parsed)
        if bad_q or bad_a:
            parsed.dropped["unknown_image_reference"] += 1
            continue
        if not q or not a:
            parsed.dropped["empty_pair"] += 1
            continue
        parsed.pairs.append(QA(q, a))
    return parsed


def renumber(pair: QA, k: int) -> QA:
    """A single-image pair placed as image ``k`` of a set: ``Image1`` becomes ``Image{k}``."""
    if k == 1:
        return pair
    sub = lambda s: REFERENCE_RE.sub(f"Image{k}", s)  # noqa: E731 - parse_reply allowed only Image1 here
    return QA(sub(pair.question), sub(pair.answer))


__all__ = ["QA", "Parsed", "parse_reply", "renumber", "PLACEHOLDER_RE", "REFERENCE_RE"]
