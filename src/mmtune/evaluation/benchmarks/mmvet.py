"""MM-Vet: few-shot correctness scores in {0.0, ..., 1.0}, N judge runs, capability tables.

Protocol (MM-Vet paper, arXiv:2308.02490, and its evaluator, github.com/yuweihao/MM-Vet): the judge completes the last row of a few-shot
table (question | ground truth | prediction | correctness). A reply whose first token is
not a number in [0, 1] is retried with the temperature raised by 0.5, at most
``max_tries`` tries, then scored 0. Total = mean x 100; per capability = mean over the
items needing it; per capability integration = mean over items with exactly that set.
Each run is a real judge call (the run index is part of the cache key); totals are
reported as mean and population std over runs (``numpy.std`` default, ddof 0).

The judge is text-only (the official grader sends no image) and can be a different
model from the run's other judge (``mmvet.judge_model``: GPT-4-0613 in the paper).

Prompts: mmtune's own few-shot prompt is the default. The official evaluator's prompt
can be given with ``prompt_file``: a file without ``{question}`` placeholders is used as
the official script does (prompt, newline, then the row ``question | truth | prediction |``,
with a "digit" hint on retries). Every result records the prompt's name and hash and
whether its figures are comparable with published ones (official prompt, GPT-4-0613).

Output files follow the official evaluator (``<model>_[bardset_]<judge>-cap-score-<N>runs.csv``,
``...-cap-int-score-...``, ``<model>_<judge>-grade-<N>runs.json``): an unnamed first header
cell (the model is the row label), capabilities ordered by how many items need them,
capability sets ordered by how many items have exactly that set (ties in order of first
appearance; a set is named by its capabilities joined with ``_`` in the order its first
item lists them), then ``total``, ``std`` and ``runs`` (the per-run totals as a list).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.evaluation.benchmarks.base import Benchmark, BenchmarkWork, RunContext, count_image_items
from mmtune.evaluation.benchmarks.common import PROMPT_DIR, fill_prompt
from mmtune.evaluation.benchmarks.registry import register
from mmtune.evaluation.results import BenchmarkResult
from mmtune.io.nofollow import open_output, write_output_text

__all__ = [
    "MMVetConfig",
    "CAPABILITIES",
    "MMVetItem",
    "ItemScore",
    "JudgePrompt",
    "load_items",
    "load_predictions",
    "load_judge_prompt",
    "parse_correctness",
    "capability_integration",
    "score_mmvet",
    "official_file_names",
    "write_official_files",
    "runs_from_grades",
    "MMVetBenchmark",
]


@dataclass
class MMVetConfig:
    data_path: Optional[str] = None
    """``mm-vet.json``."""
    image_root: Optional[str] = None
    """Directory of MM-Vet's images."""
    predictions: Optional[str] = None
    """Answers to score instead of generating: MM-Vet results JSON ``{"v1_0": "answer", ...}``
    or LLaVA-style answer JSONL (``question_id`` / ``text`` per line)."""
    runs: int = 5
    """Judge runs; totals are reported as mean and std over runs (the paper uses 5)."""
    max_tries: int = 5
    """Tries per item and run; each unparsable reply raises the temperature by 0.5."""
    judge_model: Optional[str] = None
    """MM-Vet's own judge model (the paper: ``gpt-4-0613``); ``None`` = ``eval.judge``'s model.
    MM-Vet is always judged text-only, whatever ``judge.send_images`` says."""
    max_tokens: int = 3
    """Reply budget of a judge call: the reply is one number (the official grader allows 3 tokens)."""
    prompt_file: Optional[str] = None
    """The official evaluator's prompt saved to a file (no placeholders: the row is appended
    as the official script does), or a template with ``{question}``, ``{answer}``,
    ``{prediction}``. ``None`` = mmtune's own prompt (figures not comparable with published ones)."""
    bard_subset: Optional[str] = None
    """MM-Vet's ``bard_set.json``: evaluate only those items (file names get ``bardset_``)."""
    limit: Optional[int] = None
    """Evaluate only the first N items."""

#: sha256 of the official MM-Vet evaluator's few-shot prompt (surrounding whitespace
#: stripped). A prompt file with this hash is the official prompt.
OFFICIAL_PROMPT_SHA256 = "f23108ec5f7a92d29c2e270842bb9cc7423b0504eeafd433894744f88a3fa872"
#: the judge model of the MM-Vet paper and of the MMDU paper's Table 3
PAPER_JUDGE = "gpt-4-0613"
_RETRY_HINT = "\nPredict the correctness of the answer (digit): "

CAPABILITIES = ("rec", "ocr", "know", "gen", "spat", "math")


@dataclass
class MMVetItem:
    id: str
    question: str
    answer: str
    capability: tuple[str, ...]
    image: Optional[str] = None
    image_root: Optional[str] = field(default=None, compare=False)
    """The real image root ``image`` lies in (it is opened only inside it); ``None``: not confined."""


def _subset_ids(path: str) -> set[str]:
    from mmtune.evaluation.benchmarks.common import load_json_or_jsonl

    data = load_json_or_jsonl(path)
    if isinstance(data, dict):
        return {str(k) for k in data}
    if isinstance(data, list):
        return {str(k) for k in data}
    raise ValueError(f"{path}: expected the Bard subset as a JSON dict or list of question ids (v1_0, ...)")


def load_items(path: str, *, image_root: Optional[str] = None, limit: Optional[int] = None,
               subset: Optional[str] = None, allow_absolute_image_paths: bool = False, check_images: str = "none",
               image_limits: Any = None) -> list[MMVetItem]:
    """Read ``mm-vet.json`` (a dict keyed ``v1_0``..); ``subset``: MM-Vet's ``bard_set.json``.

    Image names resolve under ``image_root`` (default: the file's folder) by the data layer's
    path rule; ``check_images="verify"`` also opens each file's header (exists, is an image,
    within ``image_limits``). Read as strictly as training data: a key written twice, an item
    that is no object or lacks a text field, a lone surrogate, a bad image path: every
    problem is listed with the item and the file is refused.

    Raises:
        BenchmarkDataError: listing the problems.
    """
    from mmtune.data.validation import ImageChecker, Problem
    from mmtune.evaluation.benchmarks.common import checked_item_image, read_records, refuse

    records, problems = read_records(path)
    if records and any(key is None for key, _ in records):
        raise ValueError(f"{path}: expected MM-Vet's dict keyed by question id (v1_0, v1_1, ...)")
    keep = _subset_ids(subset) if subset else None
    if keep is not None:
        unknown = sorted(keep - {key for key, _ in records})
        if unknown:
            raise ValueError(f"{subset}: ids {unknown[:10]} are not in {path}; is it MM-Vet's bard_set.json?")
    checker = ImageChecker(check_images, image_limits)
    items = []
    for index, (key, value) in enumerate(records):
        if keep is not None and key not in keep:
            continue

        def bad(detail: str, code: str = "malformed_record") -> None:
            problems.append(Problem(code, key, index, None, detail))

        if not isinstance(value, dict):
            bad(f"item is a JSON {type(value).__name__}, not an object with question, answer and capability")
            continue
        missing = [k for k in ("question", "answer", "capability") if k not in value]
        wrong = [k for k in ("question", "answer") if k in value and not isinstance(value[k], str)]
        capability = value.get("capability", [])
        if missing or wrong or not (isinstance(capability, list) and all(isinstance(c, str) for c in capability)):
            bad(f"missing {missing}" if missing else f"{wrong or ['capability']} must be text (capability: a list "
                                                     "of names)")
            continue
        unknown_caps = [c for c in capability if c not in CAPABILITIES]
        if unknown_caps:
            bad(f"unknown capability {unknown_caps}; known: {list(CAPABILITIES)}")
        image = value.get("imagename")
        if image is not None and not isinstance(image, str):
            bad(f"imagename must be a file name, not a JSON {type(image).__name__}")
            continue
        if image:
            image, root, found = checked_item_image(image, image_root, Path(path), checker,
                                              allow_absolute=allow_absolute_image_paths)
            for detail, code in found:
                bad(detail, code)
            if image is None:
                continue
        items.append(MMVetItem(key, value["question"], value["answer"], tuple(capability), image or None,
                               root if image else None))
    refuse(path, problems, "MM-Vet file (a JSON object keyed by question id)")
    return items[:limit] if limit is not None else items


def _question_id(raw: Any) -> str:
    """``7`` / ``"7"`` (LLaVA's answer files number the questions) -> ``v1_7``; ``v1_7`` stays."""
    text = str(raw).strip()
    return f"v1_{text}" if text.isdigit() else text


def load_predictions(path: str) -> dict[str, str]:
    """Model answers keyed by question id, from the files common tools write:

    * MM-Vet's results JSON ``{"v1_0": "answer", ...}`` (values may also be records with
      ``text`` / ``answer`` / ``response``);
    * LLaVA-style answer JSONL (or a JSON list): one ``{"question_id": 0 | "v1_0", "text": ...}`` per line;
    * mmtune's own generation JSONL (``dialogue_id`` / ``answer``).

    Raises:
        ValueError: naming the record that has no id or no answer text.
    """
    from mmtune.evaluation.benchmarks.common import load_json_or_jsonl

    data = load_json_or_jsonl(path)
    out: dict[str, str] = {}

    def text_of(value: Any, where: str) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, dict):
            for key in ("text", "answer", "response", "prediction"):
                if isinstance(value.get(key), str):
                    return value[key]
        raise ValueError(f"{path}: {where} has no answer text (expected a string or a 'text'/'answer' field)")

    if isinstance(data, dict):
        for key, value in data.items():
            out[_question_id(key)] = text_of(value, f"question {key}")
        return out
    if isinstance(data, list):
        for number, record in enumerate(data, 1):
            if not isinstance(record, dict):
                raise ValueError(f"{path}: record {number} is not an object")
            raw_id = next((record[k] for k in ("question_id", "dialogue_id", "id") if k in record), None)
            if raw_id is None:
                raise ValueError(f"{path}: record {number} has no question_id")
            if "dialogue_id" in record and record.get("answer") is None:
                continue  # a skipped turn of a generation file: a missing answer
            out[_question_id(raw_id)] = text_of(record, f"record {number} ({raw_id})")
        return out
    raise ValueError(f"{path}: expected MM-Vet results {{\"v1_0\": \"answer\"}} or answer JSONL with question_id/text")


@dataclass(frozen=True)
class JudgePrompt:
    """The judge prompt and how it is identified in every report."""

    text: str
    name: str
    sha256: str
    official: bool
    """The official evaluator's prompt (row appended the official way)."""

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "official": self.official}


def load_judge_prompt(prompt_file: Optional[str]) -> JudgePrompt:
    """mmtune's prompt (``None``) or a user's file: with the three placeholders it is a
    template; without any, it is taken as the official few-shot prompt."""
    path = Path(prompt_file) if prompt_file else PROMPT_DIR / "mmvet_judge.txt"
    text = path.read_text(encoding="utf-8")
    digest = hashlib.sha256(text.strip().encode("utf-8")).hexdigest()
    fields = [f for f in ("question", "answer", "prediction") if "{" + f + "}" in text]
    name = f"builtin:{path.name}" if not prompt_file else path.name
    if not fields:
        return JudgePrompt(text, name, digest, True)
    if len(fields) != 3:
        missing = sorted({"question", "answer", "prediction"} - set(fields))
        raise ValueError(f"prompt file {path} has some placeholders but lacks {missing}; use all three, or none "
                         "(the official prompt, to which the row is appended)")
    return JudgePrompt(text, name, digest, False)


def judge_prompt_text(prompt: JudgePrompt, item: "MMVetItem", prediction: str, attempt: int) -> str:
    if not prompt.official:
        return fill_prompt(prompt.text, question=item.question, answer=item.answer, prediction=prediction)
    truth = item.answer.replace("<AND>", " <AND> ").replace("<OR>", " <OR> ")
    row = " | ".join([item.question, truth, prediction, ""])
    return prompt.text + "\n" + row + (_RETRY_HINT if attempt > 0 else "")


def comparability(prompt: JudgePrompt, judge_model: Optional[str], runs: int) -> tuple[bool, list[str]]:
    """Whether MM-Vet figures can be set beside published ones, and why not."""
    notes = []
    if not (prompt.official and prompt.sha256 == OFFICIAL_PROMPT_SHA256):
        notes.append(f"judge prompt {prompt.name} (sha256 {prompt.sha256[:12]}) is not the official MM-Vet prompt; "
                     "pass it with --prompt-file / eval.mmvet.prompt_file")
    if not (judge_model or "").startswith(PAPER_JUDGE):
        notes.append(f"judge model {judge_model!r} is not the paper's {PAPER_JUDGE}")
    if runs < 5:
        notes.append(f"{runs} judge run(s); the paper reports the mean of 5")
    return not notes, notes


def capability_integration(capability: Sequence[str]) -> str:
    """The name of a capability set, in MM-Vet's canonical order (e.g. ``ocr_spat``)."""
    return "_".join(c for c in CAPABILITIES if c in capability)


# Possessive quantifiers and a lookahead that scans the following word once: linear in the
# reply whatever it holds. "0,5" (a decimal comma) and "0.5.1" are no number.
_NUMBER = re.compile(r"^[\s\"'*]*+(\d++(?:\.\d++)?+|\.\d++)(?!,\d)(?=(?:[^\W\d]|\.)*+(?![\w.]))")
MAX_REPLY_CHARS = 1024
"""Characters of a reply :func:`parse_correctness` reads: the grade is its first token."""
_NOT_A_GRADE = "the reply does not start with a number in [0, 1]"


def parse_correctness(reply: Optional[str]) -> Optional[float]:
    """The score at the start of the reply, if it is a number in [0, 1]; else None.

    Like the official grader this reads the first token; it additionally tolerates
    quotes, bold markers and a trailing period ("**0.5**."). Numbers are read whole:
    ``0.5e1`` is rejected, not read as 0.5, and ``0,5`` is not read as 0. Only the first
    :data:`MAX_REPLY_CHARS` characters are read.
    """
    if not reply or not isinstance(reply, str):
        return None
    match = _NUMBER.match(reply[:MAX_REPLY_CHARS])
    if not match:
        return None
    value = float(match.group(1))
    return value if 0.0 <= value <= 1.0 else None


@dataclass
class ItemScore:
    id: str
    run: int
    score: float
    tries: int
    status: str
    """ok | unparsed (all tries failed to parse; scored 0) | failed (judge call failed; scored 0) | missing."""
    content: Optional[str] = None
    """The judge's last reply."""
    judge_error: Optional[dict[str, Any]] = None
    """``{"status", "message"}`` of a failed judge call (key redacted)."""
    detail: str = ""
    """Why an unparsed item's last reply gave no grade."""


def _judge_run(items, predictions, judge, prompt: JudgePrompt, cfg: MMVetConfig, run: int, progress: bool) -> list[ItemScore]:
    from mmtune.evaluation.judge.client import JudgeRequest

    scores: dict[str, ItemScore] = {}
    pending = [item for item in items if item.id in predictions]
    for item in items:
        if item.id not in predictions:
            scores[item.id] = ItemScore(item.id, run, 0.0, 0, "missing")
    last: dict[str, Optional[str]] = {}
    reasons: dict[str, str] = {}
    for attempt in range(cfg.max_tries):
        if not pending:
            break
        temperature = 0.5 * attempt  # MM-Vet: raise the temperature by 0.5 per unparsable reply
        requests = [
            JudgeRequest(
                judge_prompt_text(prompt, item, str(predictions[item.id]).strip(), attempt),
                temperature=temperature,
                max_tokens=cfg.max_tokens,
                run_index=run,
                model=cfg.judge_model,
            )
            for item in pending
        ]
        replies = judge.judge_many(requests, progress=progress, desc=f"MM-Vet judge run {run} try {attempt + 1}")
        still = []
        for item, reply in zip(pending, replies):
            if not reply.ok:
                scores[item.id] = ItemScore(item.id, run, 0.0, attempt + 1, "failed", judge_error=reply.error_record())
                continue
            last[item.id] = reply.content
            value = None if reply.unreadable else parse_correctness(reply.content)
            if value is None:
                reasons[item.id] = reply.unreadable or _NOT_A_GRADE
                still.append(item)
            else:
                scores[item.id] = ItemScore(item.id, run, value, attempt + 1, "ok", reply.content)
        pending = still
    for item in pending:
        scores[item.id] = ItemScore(item.id, run, 0.0, cfg.max_tries, "unparsed", last.get(item.id),
                                    detail=reasons.get(item.id, ""))
    return [scores[item.id] for item in items]


def _tables(items: Sequence[MMVetItem], run_scores: list[ItemScore]) -> tuple[dict[str, float], dict[str, float]]:
    by_id = {s.id: s.score for s in run_scores}
    caps = {}
    for cap in CAPABILITIES:
        values = [by_id[i.id] for i in items if cap in i.capability]
        if values:
            caps[cap] = 100 * sum(values) / len(values)
    ints: dict[str, list[float]] = {}
    for item in items:
        ints.setdefault(capability_integration(item.capability), []).append(by_id[item.id])
    integ = {k: 100 * sum(v) / len(v) for k, v in ints.items()}
    caps["total"] = 100 * sum(by_id.values()) / len(by_id) if by_id else float("nan")
    integ["total"] = caps["total"]
    valid = [s.score for s in run_scores if s.status == "ok"]
    caps["valid_total"] = 100 * sum(valid) / len(valid) if valid else float("nan")
    return caps, integ


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def score_mmvet(
    items: Sequence[MMVetItem],
    predictions: dict[str, str],
    judge: Any,
    cfg: MMVetConfig,
    *,
    run: str,
    model: str,
    context_length: Optional[int] = None,
    progress: bool = False,
) -> tuple[BenchmarkResult, list[list[ItemScore]]]:
    """Judge ``predictions`` (``{"v1_0": answer}``) ``cfg.runs`` times and aggregate.

    ``metrics["total"]`` counts every item (failed, unparsed and missing as 0);
    ``metrics["valid/total"]`` averages only the items the judge scored.
    """
    prompt = load_judge_prompt(cfg.prompt_file)
    runs = [_judge_run(items, predictions, judge, prompt, cfg, r, progress) for r in range(cfg.runs)]
    cap_runs, int_runs = zip(*(_tables(items, r) for r in runs))
    metrics: dict[str, float] = {}
    for name in cap_runs[0]:
        if name != "valid_total":
            metrics[name] = _mean_std([t[name] for t in cap_runs])[0]
    metrics["total"], metrics["total_std"] = _mean_std([t["total"] for t in cap_runs])
    metrics["valid/total"] = _mean_std([t["valid_total"] for t in cap_runs])[0]
    for name in int_runs[0]:
        if name != "total":
            metrics[f"int/{name}"] = _mean_std([t[name] for t in int_runs])[0]
    flat = [s for r in runs for s in r]
    counts = {
        "items": len(items),
        "runs": cfg.runs,
        "valid": sum(s.status == "ok" for s in flat),
        "missing": sum(s.status == "missing" for s in runs[0]),
        "unparsed": sum(s.status == "unparsed" for s in flat),
        "failed": sum(s.status == "failed" for s in flat),
        "retried": sum(s.tries > 1 for s in flat),
    }
    judge_model = cfg.judge_model or getattr(judge, "model", None)
    comparable, notes = comparability(prompt, judge_model, cfg.runs)
    meta = {
        "unparsed_reasons": dict(Counter(s.detail for s in flat if s.status == "unparsed").most_common()),
        "run_totals": [t["total"] for t in cap_runs],
        "capability_runs": [{k: v for k, v in t.items() if k != "valid_total"} for t in cap_runs],
        "integration_runs": list(int_runs),
        "judge_model": judge_model,
        "judge_images": False,
        "prompt": prompt.record(),
        "prompt_file": cfg.prompt_file or "builtin:mmvet_judge.txt",
        "comparable_with_published": comparable,
        "comparability_notes": notes,
        "subset": "bard" if cfg.bard_subset else None,
    }
    return BenchmarkResult(run, model, "mmvet", metrics, counts, meta, context_length), runs


def _safe(name: str) -> str:
    """A model / judge label usable in a file name (checkpoint paths contain slashes)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.strip("/")) or "model"


def official_file_names(model: str, judge_model: str, runs: int, *, bard_subset: bool = False) -> dict[str, str]:
    """The official evaluator's file names for ``model`` judged by ``judge_model``."""
    model, judge_model = _safe(model), _safe(judge_model)
    subset = "bardset_" if bard_subset else ""
    return {
        "grade": f"{model}_{judge_model}-grade-{runs}runs.json",
        "cap": f"{model}_{subset}{judge_model}-cap-score-{runs}runs.csv",
        "cap_int": f"{model}_{subset}{judge_model}-cap-int-score-{runs}runs.csv",
    }


def runs_from_grades(grades: dict[str, Any], items: Sequence[MMVetItem]) -> list[list[ItemScore]]:
    """Per-run item scores from an official grade file (``{id: {"model", "content", "score"}}``),
    e.g. to re-export the tables of a grading done elsewhere."""
    missing = [i.id for i in items if i.id not in grades]
    if missing:
        raise ValueError(f"grade file lacks items {missing[:10]}")
    n = min(len(grades[i.id]["score"]) for i in items)
    return [[ItemScore(i.id, r, float(grades[i.id]["score"][r]), 1, "ok", grades[i.id]["content"][r]) for i in items]
            for r in range(n)]


def _fmt(value: float) -> str:
    return repr(round(float(value), 1))


def write_official_files(
    items: Sequence[MMVetItem],
    runs: Sequence[Sequence[ItemScore]],
    out_dir: str,
    *,
    model: str,
    judge_model: str,
    bard_subset: bool = False,
) -> dict[str, Path]:
    """Write the grade JSON and the two score CSVs exactly as MM-Vet's evaluator lays them out."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = official_file_names(model, judge_model, len(runs), bard_subset=bard_subset)
    scores = [{s.id: s for s in run} for run in runs]

    cap_counter: Counter[str] = Counter()
    set_names: dict[frozenset, str] = {}
    set_counts: Counter[frozenset] = Counter()
    for item in items:
        cap_counter.update(dict.fromkeys(item.capability, 1))
        key = frozenset(item.capability)
        set_names.setdefault(key, "_".join(dict.fromkeys(item.capability)))
        set_counts[key] += 1
    caps = [c for c, _ in cap_counter.most_common()]  # ties keep first-seen order
    sets = sorted(set_names, key=lambda k: -set_counts[k])  # stable: ties keep first-seen order

    totals = [100 * sum(run[i.id].score for i in items) / len(items) for run in scores]
    mean_total, std_total = _mean_std(totals)
    runs_cell = "[" + ", ".join(_fmt(t) for t in totals) + "]"

    def column(select) -> str:
        chosen = [i for i in items if select(i)]
        return _fmt(sum(100 * sum(run[i.id].score for i in chosen) / len(chosen) for run in scores) / len(scores))

    paths = {}
    for kind, columns, selectors in (
        ("cap", caps, [lambda i, c=c: c in i.capability for c in caps]),
        ("cap_int", [set_names[k] for k in sets], [lambda i, k=k: frozenset(i.capability) == k for k in sets]),
    ):
        path = out / names[kind]
        with open_output(path, "w", newline="") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(["", *columns, "total", "std", "runs"])
            writer.writerow([model, *[column(sel) for sel in selectors], _fmt(mean_total), _fmt(std_total), runs_cell])
        paths[kind] = path
    grades = {
        i.id: {"model": [judge_model] * len(runs), "content": [run[i.id].content for run in scores],
               "score": [run[i.id].score for run in scores]}
        for i in items
    }
    paths["grade"] = out / names["grade"]
    write_output_text(paths["grade"], json.dumps(grades, indent=4, ensure_ascii=False))
    return paths


@register
class MMVetBenchmark(Benchmark):
    """MM-Vet: N judge runs of a text-only few-shot grader; official CSVs beside the result."""

    name = "mmvet"
    settings_class = MMVetConfig
    uses_judge = True

    def check(self, cfg: Any) -> list[str]:
        sub = cfg.mmvet
        problems = []
        if not sub.data_path:
            problems.append("eval.mmvet.data_path is required: mm-vet.json holds the questions and ground truths")
        if sub.runs < 1:
            problems.append(f"eval.mmvet.runs={sub.runs}: must be >= 1")
        if sub.max_tokens < 1:
            problems.append(f"eval.mmvet.max_tokens={sub.max_tokens}: must be >= 1")
        for key in ("prompt_file", "bard_subset"):
            value = getattr(sub, key)
            if value and not Path(value).is_file():
                problems.append(f"eval.mmvet.{key}={value!r}: file not found")
        return problems

    def image_checks(self, sub: Any, ctx: RunContext) -> str:
        return "none" if sub.predictions else "verify"  # the MM-Vet judge is text-only: only generation decodes

    def load(self, sub: Any, ctx: RunContext) -> list[MMVetItem]:
        return load_items(sub.data_path, image_root=sub.image_root, limit=sub.limit, subset=sub.bard_subset,
                          allow_absolute_image_paths=ctx.cfg.allow_absolute_image_paths,
                          check_images=self.image_checks(sub, ctx), image_limits=ctx.image_limits)

    def dialogues(self, items, sub):
        from mmtune.data.dialogue import Dialogue, Image, Turn

        # the generator answers (user, assistant) exchanges: the reference slot stays empty
        return [Dialogue(i.id, "mmvet", (Turn("user", ((Image(i.image, i.image_root), "\n") if i.image else ()) + (i.question,)),
                                         Turn("assistant", ("",))))
                for i in items]

    def load_predictions(self, path, items, sub):
        return load_predictions(path)

    def from_generations(self, records, items):
        return {r.dialogue_id: r.answer or "" for r in records}

    def score(self, items, predictions, ctx, sub):
        result, runs = score_mmvet(items, predictions, ctx.judge, sub, run=ctx.run, model=ctx.model,
                                   context_length=ctx.context_length, progress=ctx.cfg.progress)
        return result, [s for r in runs for s in r]

    def write_files(self, result, rows, items, predictions, ctx, sub):
        if not sub.predictions:  # generated answers, in MM-Vet's results format for other graders
            write_output_text(ctx.out / "mmvet_results.json", json.dumps(predictions, indent=2, ensure_ascii=False))
        runs = [[s for s in rows if s.run == r] for r in range(sub.runs)]
        paths = write_official_files(items, runs, str(ctx.out), model=ctx.model,
                                     judge_model=result.meta.get("judge_model") or "judge", bard_subset=bool(sub.bard_subset))
        result.meta["official_files"] = {k: p.name for k, p in paths.items()}

    def count_items(self, sub: Any, cache_dir: Optional[str], problems: list[str]) -> BenchmarkWork:
        """One answer per item, ``runs`` judge calls each; images are ``imagename`` under ``image_root``."""
        return count_image_items(self, sub, problems, lambda item: str(item.get("imagename", "")), sub.runs)

    viewer_scale = "x100 (mean over judge runs)"

    def viewer_entries(self, sub: Any, out: Path, *, allow_absolute_image_paths: bool = False) -> Optional[list[Any]]:
        """One entry per item: its answer and the score of every judge run."""
        from mmtune.evaluation.reporting.viewer import ViewerEntry, finite_mean, read_jsonl

        items = load_items(sub.data_path, image_root=sub.image_root, limit=sub.limit,
                           allow_absolute_image_paths=allow_absolute_image_paths)
        runs: dict[str, list[dict[str, Any]]] = {}
        for row in read_jsonl(out / "details" / "mmvet.jsonl"):
            runs.setdefault(row["id"], []).append(row)
        answers = {r["dialogue_id"]: r.get("answer") for r in read_jsonl(out / "generations" / "mmvet.jsonl")}
        if not answers and (out / "mmvet_results.json").is_file():
            answers = json.loads((out / "mmvet_results.json").read_text(encoding="utf-8"))
        entries = []
        for item in items:
            scored = sorted(runs.get(item.id, []), key=lambda r: r.get("run", 0))
            scores = {f"run {r.get('run', i)}": float(r["score"]) for i, r in enumerate(scored)}
            status = ", ".join(sorted({r.get("status", "") for r in scored})) or "unscored"
            turn = {"question": item.question, "images": [item.image] if item.image else [],
                    "answer": answers.get(item.id), "reference": item.answer, "scores": scores, "status": status,
                    "rationale": ""}
            score = finite_mean(list(scores.values()))
            entries.append(ViewerEntry(item.id, None if score is None else 100.0 * score, [turn],
                                       {"capability": list(item.capability)}))
        return entries

    def report_section(self, result: BenchmarkResult, out: Path) -> tuple[list[str], list[Path]]:
        from mmtune.evaluation.reporting.plots import plot_bars
        from mmtune.evaluation.reporting.report import markdown_table

        m = result.metrics
        caps = [k for k in CAPABILITIES if k in m]
        lines = [markdown_table([*caps, "total", "std", "total (valid judgements)"],
                                [[*[m[c] for c in caps], m["total"], m["total_std"], m.get("valid/total", float("nan"))]])]
        ints = sorted(k for k in m if k.startswith("int/"))
        lines += ["", markdown_table([k[4:] for k in ints], [[m[k] for k in ints]])]
        prompt = result.meta.get("prompt") or {}
        comparable = result.meta.get("comparable_with_published")
        lines += ["", f"Judge {result.meta.get('judge_model')!s} (text only), prompt {prompt.get('name')} "
                      f"(sha256 {str(prompt.get('sha256', ''))[:12]}); comparable with published figures: "
                      f"{'yes' if comparable else 'no'}"]
        lines += [f"- {note}" for note in result.meta.get("comparability_notes", [])]
        plots = [plot_bars(out / "mmvet_capabilities.png", "MM-Vet by capability", {"score": {c: m[c] for c in caps}}, "score")]
        return lines, plots
