"""MMDU: one judge call per turn, seven 1-10 scores parsed strictly, micro-averaged x10.

Protocol (MMDU paper, arXiv:2406.11833, and its evaluation code, github.com/Liuziyu77/MMDU): the judge sees the question, the reference answer
and the model's answer (plus the dialogue's images when ``judge.send_images``), explains,
then gives integer scores for Creativity, Richness, Visual Perception, Logical
Coherence, Answer Accuracy, Image Relationship Understanding and Overall Score.

Where mmtune deliberately differs from the official script:

* the reply is parsed without ``eval()``: JSON, a Python-style dict (``ast.literal_eval``
  on the extracted ``{...}`` only, which evaluates literals and nothing else) or
  ``Key: n`` lines; a reply parses only when all seven keys are present with a value in
  1..10 or ``N/A``;
* nothing is dropped silently: ``all turns`` scores unparsed replies, failed judge calls
  and missing answers as 0 (VLMEvalKit's first row); ``valid`` averages each dimension
  over the turns that gave it a number; every category is counted;
* ``N/A`` for a dimension is counted (``counts["na"]``) and treated like an unparsed
  value for that dimension only; ``NaN``, ``Nancy`` or ``8,5`` are no value at all (not N/A,
  not 8);
* the parser runs in time linear in the reply, and reads at most the last
  :data:`MAX_REPLY_CHARS` characters of it (the verdict follows the reasoning);
* more than ``judge.max_unparsed_share`` of unparsed replies fail the run, like failed calls.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.data.dialogue import Dialogue
from mmtune.evaluation.benchmarks.base import DialogueBenchmark
from mmtune.evaluation.benchmarks.common import TurnPrediction, fill_prompt, load_prompt
from mmtune.evaluation.generation.generator import question_text
from mmtune.evaluation.benchmarks.registry import register
from mmtune.evaluation.results import BenchmarkResult

__all__ = ["MMDUConfig", "DIMENSIONS", "DIMENSION_NAMES", "MAX_REPLY_CHARS", "ParsedScores", "parse_scores", "TurnScore", "aggregate", "score_mmdu", "MMDUBenchmark"]


@dataclass
class MMDUConfig:
    data_path: Optional[str] = None
    """MMDU ``benchmark.json`` (references and questions)."""
    image_root: Optional[str] = None
    """Directory the ``image`` paths are relative to (leading ``/`` is stripped)."""
    predictions: Optional[str] = None
    """Score this file instead of generating: MMDU-schema dialogues whose assistant turns
    hold the model's answers, or a generation JSONL written by mmtune."""
    prompt_file: Optional[str] = None
    """Replacement judge prompt with ``{question}``, ``{reference}``, ``{answer}`` fields."""
    limit: Optional[int] = None
    """Evaluate only the first N dialogues (smoke runs)."""

DIMENSIONS = ("C", "R", "VP", "LC", "AA", "IRU", "Overall")
DIMENSION_NAMES = {
    "C": "Creativity",
    "R": "Richness",
    "VP": "Visual Perception",
    "LC": "Logical Coherence",
    "AA": "Answer Accuracy",
    "IRU": "Image Relationship Understanding",
    "Overall": "Overall Score",
}
_KEY_PATTERNS = {
    "C": r"creativity",
    "R": r"richness",
    "VP": r"visual[\s_-]*perception",
    "LC": r"logical[\s_-]*coherence",
    "AA": r"answer[\s_-]*accuracy",
    "IRU": r"image[\s_-]*relationship[\s_-]*understanding",
    "Overall": r"overall(?:[\s_-]*score)?",
}
_KEY_RE = "|".join(f"(?P<{k}>{p})" for k, p in _KEY_PATTERNS.items())
# A number is read whole, exponent included, so that "8.5e1" or "1e308" is rejected as a
# value outside 1..10 instead of being read as 8.5 or 1; "8,5" (a decimal comma) is no value,
# nor is a number whose word goes on to another digit ("7x2", "8.5.1"). N/A must end there
# ("NaN", "Nancy" are words). Possessive quantifiers and a lookahead that scans the
# following word once keep every match linear: no reply makes the engine backtrack.
_VALUE_RE = (r"(?P<value>(?:N\s*+/\s*+A|NA)(?![\w/])"
             r"|\d++(?:\.\d++)?+(?:[eE][+-]?\d++)?+(?!,\d)(?=(?:[^\W\d]|\.)*+(?![\w.])))")
# "Key": 7 | 'Key': '7' | **Key**: 7 | - Key = 7/10 ; key matched case-insensitively.
_PAIR = re.compile(
    rf"[\"'*]*+\b(?:{_KEY_RE})\b[\"'*]*+\s*+[:=：]\s*+[\"'*]*+\s*+{_VALUE_RE}", re.IGNORECASE
)
_BLOCK = re.compile(r"\{[^{}]*\}")
_MAX_BLOCK = 10_000  # literal_eval on huge strings can exhaust memory; judge dicts are short
MAX_REPLY_CHARS = 32_768
"""Longest reply tail the parser reads (a 2048-token reply is about 8k characters)."""


@dataclass
class ParsedScores:
    ok: bool
    scores: dict[str, Optional[float]] = field(default_factory=dict)
    """Dimension -> 1..10, or None for N/A. Empty when not ``ok``."""
    na: list[str] = field(default_factory=list)
    method: str = ""
    """Which parser matched: json, literal, pairs-in-block, lines."""
    error: str = ""


def _normalize_key(key: str) -> Optional[str]:
    for dim, pattern in _KEY_PATTERNS.items():
        if re.fullmatch(pattern, key.strip().strip("*\"' "), flags=re.IGNORECASE):
            return dim
    return None


def _value(raw: Any) -> tuple[bool, Optional[float]]:
    """(valid, score): score None means N/A."""
    if isinstance(raw, bool):
        return False, None
    if isinstance(raw, (int, float)):
        return (1 <= raw <= 10), float(raw)
    if isinstance(raw, str):
        text = raw.strip()
        if re.fullmatch(r"N\s*/\s*A|NA|none|null", text, flags=re.IGNORECASE):
            return True, None
        if re.fullmatch(r"\d+(?:\.\d+)?", text):
            return _value(float(text))
    if raw is None:
        return True, None
    return False, None


def _missing(scores: dict[str, Optional[float]]) -> str:
    return "no value for " + ", ".join(DIMENSION_NAMES[d] for d in DIMENSIONS if d not in scores)


def _from_mapping(mapping: dict[Any, Any]) -> tuple[Optional[ParsedScores], str]:
    """The scores of a parsed dict, or ``(None, why not)``."""
    scores: dict[str, Optional[float]] = {}
    for key, raw in mapping.items():
        dim = _normalize_key(str(key))
        if dim is None:
            continue
        valid, score = _value(raw)
        if not valid:
            return None, f"{DIMENSION_NAMES[dim]} = {str(raw)[:20]!r} is not a score in 1..10 or N/A"
        scores[dim] = score
    if set(scores) != set(DIMENSIONS):
        return None, _missing(scores)
    return ParsedScores(True, scores, [d for d in DIMENSIONS if scores[d] is None]), ""


def _from_pairs(text: str) -> tuple[Optional[ParsedScores], str]:
    """The scores of ``Key: value`` pairs in ``text``, or ``(None, why not)``."""
    scores: dict[str, Optional[float]] = {}
    rejected = ""
    for match in _PAIR.finditer(text):
        dim = next(k for k in DIMENSIONS if match.group(k))
        valid, score = _value(match.group("value"))
        if valid:
            scores[dim] = score  # the last occurrence wins: the final verdict follows the reasoning
        else:
            rejected = f"{DIMENSION_NAMES[dim]} = {match.group('value')[:20]!r} is not a score in 1..10 or N/A"
    if set(scores) != set(DIMENSIONS):
        return None, rejected or _missing(scores)
    return ParsedScores(True, scores, [d for d in DIMENSIONS if scores[d] is None]), ""


def parse_scores(reply: str) -> ParsedScores:
    """Parse a judge reply into the seven scores, never evaluating code.

    Tries, in order: the last ``{...}`` block that parses as JSON, then as a Python
    literal (single quotes), then ``"Key": n`` pairs inside it; finally ``Key: n``
    lines anywhere in the reply. Only the last :data:`MAX_REPLY_CHARS` characters are read.
    The error of a reply that does not parse says why (the first problem of the last block).
    """
    if not isinstance(reply, str) or not reply.strip():
        return ParsedScores(False, error="empty reply")
    reply = reply[-MAX_REPLY_CHARS:]
    why = ""
    for block in reversed(_BLOCK.findall(reply)):
        if len(block) > _MAX_BLOCK:
            continue
        for method, loader in (("json", json.loads), ("literal", ast.literal_eval)):
            try:
                mapping = loader(block)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if isinstance(mapping, dict):
                parsed, problem = _from_mapping(mapping)
                if parsed is not None:
                    parsed.method = method
                    return parsed
                why = why or problem
        parsed, problem = _from_pairs(block)
        if parsed is not None:
            parsed.method = "pairs-in-block"
            return parsed
        why = why or problem
    parsed, problem = _from_pairs(reply)
    if parsed is not None:
        parsed.method = "lines"
        return parsed
    return ParsedScores(False, error=f"no complete set of the seven scores found ({why or problem})")


@dataclass
class TurnScore:
    dialogue_id: str
    turn: int
    """The question/answer exchange, from 1 (as ``mmtune data check``, ``report.md`` and the viewer number turns)."""
    status: str
    """ok | unparsed | failed (judge call failed) | missing (no model answer)."""
    scores: dict[str, Optional[float]] = field(default_factory=dict)
    na: list[str] = field(default_factory=list)
    detail: str = ""
    judge_error: Optional[dict[str, Any]] = None
    """``{"status", "message"}`` of a failed judge call (key redacted)."""
    reply: str = ""
    """The judge's reply as written (its rationale), for the results viewer."""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def aggregate(turns: Sequence[TurnScore]) -> tuple[dict[str, float], dict[str, int], dict[str, Any]]:
    """Metrics (x10), counts and breakdown tables from per-turn scores.

    ``metrics[d]``: mean over all turns with 0 for anything not scored;
    ``metrics["valid/" + d]``: mean over turns that gave ``d`` a number.
    """
    metrics: dict[str, float] = {}
    for dim in DIMENSIONS:
        all_turns = [(t.scores.get(dim) or 0.0) if t.status == "ok" else 0.0 for t in turns]
        valid = [t.scores[dim] for t in turns if t.status == "ok" and t.scores.get(dim) is not None]
        metrics[dim] = 10 * _mean(all_turns) if turns else float("nan")
        metrics[f"valid/{dim}"] = 10 * _mean(valid)
    counts = {
        "turns": len(turns),
        "dialogues": len({t.dialogue_id for t in turns}),
        "valid": sum(t.status == "ok" for t in turns),
        "unparsed": sum(t.status == "unparsed" for t in turns),
        "failed": sum(t.status == "failed" for t in turns),
        "missing": sum(t.status == "missing" for t in turns),
        "na": sum(len(t.na) for t in turns),
    }
    by_dialogue: dict[str, list[TurnScore]] = {}
    by_index: dict[int, list[TurnScore]] = {}
    for t in turns:
        by_dialogue.setdefault(t.dialogue_id, []).append(t)
        by_index.setdefault(t.turn, []).append(t)

    def row(group: list[TurnScore]) -> dict[str, float]:
        out = {d: 10 * _mean([(t.scores.get(d) or 0.0) if t.status == "ok" else 0.0 for t in group]) for d in DIMENSIONS}
        out["n"] = len(group)
        return out

    meta = {
        "per_dialogue": {k: row(v) for k, v in by_dialogue.items()},
        "per_turn_index": {str(k): row(v) for k, v in sorted(by_index.items())},
        "na_by_dimension": {d: sum(d in t.na for t in turns) for d in DIMENSIONS},
    }
    return metrics, counts, meta


def build_requests(
    dialogues: Sequence[Dialogue],
    predictions: dict[tuple[str, int], TurnPrediction],
    template: str,
) -> tuple[list[tuple[str, int]], list[Any], list[tuple[str, int]]]:
    """Judge requests for every (dialogue, exchange) that has an answer; plus the missing ones."""
    from mmtune.evaluation.judge.client import JudgeRequest

    keys, requests, missing = [], [], []
    for dialogue in dialogues:
        images = dialogue.images  # with their roots: each is opened inside its own when sent
        for t, (u, a) in enumerate(dialogue.exchanges()):
            prediction = predictions.get((dialogue.id, t))
            if prediction is None:
                missing.append((dialogue.id, t))
                continue
            prompt = fill_prompt(
                template,
                question=question_text(dialogue.turns[u]),
                reference=dialogue.turns[a].text.strip(),
                answer=prediction.answer.strip(),
            )
            keys.append((dialogue.id, t))
            requests.append(JudgeRequest(prompt, images=images))
    return keys, requests, missing


def score_mmdu(
    dialogues: Sequence[Dialogue],
    predictions: dict[tuple[str, int], TurnPrediction],
    judge: Any,
    cfg: MMDUConfig,
    *,
    run: str,
    model: str,
    context_length: Optional[int] = None,
    progress: bool = False,
) -> tuple[BenchmarkResult, list[TurnScore]]:
    """Judge every turn's answer against its reference and aggregate.

    Args:
        dialogues: the benchmark (questions + reference answers).
        predictions: model answers keyed by ``(dialogue_id, exchange_index)``.
        judge: a :class:`~mmtune.evaluation.judge.client.JudgeClient`.
    """
    template = load_prompt("mmdu_judge.txt", cfg.prompt_file, ("question", "reference", "answer"))
    keys, requests, missing = build_requests(dialogues, predictions, template)
    replies = judge.judge_many(requests, progress=progress, desc="MMDU judge")
    turns: list[TurnScore] = []
    for (dialogue_id, index), reply in zip(keys, replies):
        t = index + 1  # rows number turns from 1; predictions are keyed by the exchange's position
        if not reply.ok:
            turns.append(TurnScore(dialogue_id, t, "failed", detail=reply.error or "", judge_error=reply.error_record()))
            continue
        if reply.unreadable:
            turns.append(TurnScore(dialogue_id, t, "unparsed", detail=reply.unreadable))
            continue
        parsed = parse_scores(reply.content)
        if parsed.ok:
            turns.append(TurnScore(dialogue_id, t, "ok", parsed.scores, parsed.na, parsed.method, reply=reply.content or ""))
        else:
            turns.append(TurnScore(dialogue_id, t, "unparsed", detail=parsed.error, reply=reply.content or ""))
    turns += [TurnScore(d, index + 1, "missing") for d, index in missing]
    turns.sort(key=lambda s: (s.dialogue_id, s.turn))
    metrics, counts, meta = aggregate(turns)
    reasons = Counter(_reason(t.detail) for t in turns if t.status == "unparsed")
    meta["unparsed_reasons"] = dict(reasons.most_common())
    meta["judge_model"] = getattr(judge, "model", None)
    meta["send_images"] = bool(getattr(getattr(judge, "config", None), "send_images", False))
    meta["prompt_file"] = cfg.prompt_file or "builtin:mmdu_judge.txt"
    meta["prompt"] = {"name": Path(cfg.prompt_file).name if cfg.prompt_file else "builtin:mmdu_judge.txt",
                      "sha256": hashlib.sha256(template.strip().encode("utf-8")).hexdigest()}
    result = BenchmarkResult(run, model, "mmdu", metrics, counts, meta, context_length)
    return result, turns


def _reason(detail: str) -> str:
    """An unparsed reply's reason without its values, so that like reasons count together."""
    return re.sub(r" = '[^']*'", "", detail)


@register
class MMDUBenchmark(DialogueBenchmark):
    """MMDU: the LLM judge scores every turn in seven dimensions."""

    name = "mmdu"
    settings_class = MMDUConfig
    uses_judge = True

    def score(self, items, predictions, ctx, sub):
        return score_mmdu(items, predictions, ctx.judge, sub, run=ctx.run, model=ctx.model,
                          context_length=ctx.context_length, progress=ctx.cfg.progress)

    viewer_scale = "x10 (Overall unless a dimension is chosen)"

    def viewer_turn(self, turn: dict[str, Any], row: dict[str, Any]) -> None:
        turn["scores"] = {d: v for d, v in (row.get("scores") or {}).items() if v is not None}
        if row.get("status") != "ok" and row.get("detail"):
            turn["rationale"] = turn["rationale"] or row["detail"]

    def viewer_score(self, turns: list[dict[str, Any]], rows: list[dict[str, Any]]) -> tuple[Optional[float], dict[str, Any]]:
        from mmtune.evaluation.reporting.viewer import finite_mean

        # the benchmark's "all turns" rule: an unscored turn counts 0
        dims = {d: [((row.get("scores") or {}).get(d) or 0.0) if row.get("status") == "ok" else 0.0 for row in rows]
                for d in DIMENSIONS}
        facets = {f"dim:{d}": (10 * finite_mean(v) if v else None) for d, v in dims.items()}
        return facets["dim:Overall"], facets

    def report_section(self, result: BenchmarkResult, out: Path) -> tuple[list[str], list[Path]]:
        from mmtune.evaluation.reporting.plots import plot_bars, plot_line
        from mmtune.evaluation.reporting.report import markdown_table

        m = result.metrics
        tag = f"context{result.context_length}" if result.context_length else ""
        lines = [markdown_table(["turns", *DIMENSIONS], [["all", *[m[d] for d in DIMENSIONS]],
                                                        ["valid", *[m[f"valid/{d}"] for d in DIMENSIONS]]])]
        plots = [plot_bars(out / f"mmdu{tag}_dimensions.png", "MMDU scores (x10)",
                            {"all turns": {d: m[d] for d in DIMENSIONS},
                             "valid turns": {d: m[f"valid/{d}"] for d in DIMENSIONS}}, "score")]
        per_turn = result.meta.get("per_turn_index", {})
        if per_turn:
            xs = sorted(int(k) for k in per_turn)
            plots.append(plot_line(out / f"mmdu{tag}_by_turn.png", "MMDU Overall by turn",
                                    xs, [per_turn[str(x)]["Overall"] for x in xs], "Overall (x10)", ylim=(0, 100)))
            lines += ["", markdown_table(["turn", "n", "Overall"], [[x, per_turn[str(x)]["n"], per_turn[str(x)]["Overall"]] for x in xs])]
        prompt = result.meta.get("prompt") or {}
        lines += ["", f"Judge {result.meta.get('judge_model')!s} ({'with' if result.meta.get('send_images') else 'without'} "
                      f"images), prompt {prompt.get('name')} (sha256 {str(prompt.get('sha256', ''))[:12]})"]
        return lines, plots
