"""MM-Vet: few-shot correctness scores in {0.0, ..., 1.0}, N judge runs, capability tables.

Protocol (MM-Vet paper; see FACTS.md): the judge completes the last row of a few-shot
table (question | ground truth | prediction | correctness). A reply whose first token is
not a number in [0, 1] is retried with the temperature raised by 0.5, at most
``max_tries`` tries, then scored 0. Total = mean x 100; per capability = mean over the
items needing it; per capability integration = mean over items with exactly that set.
Each run is a real judge call (the run index is part of the cache key); totals are
reported as mean and population std over runs (``numpy.std`` default, ddof 0).
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.evaluation.common import fill_prompt, load_prompt
from mmtune.evaluation.config import MMVetConfig
from mmtune.evaluation.results import BenchmarkResult

__all__ = ["CAPABILITIES", "MMVetItem", "parse_correctness", "capability_integration", "score_mmvet", "write_official_csvs"]

CAPABILITIES = ("rec", "ocr", "know", "gen", "spat", "math")


@dataclass
class MMVetItem:
    id: str
    question: str
    answer: str
    capability: tuple[str, ...]
    image: Optional[str] = None


def load_items(path: str, *, image_root: Optional[str] = None, limit: Optional[int] = None,
               allow_absolute_image_paths: bool = False) -> list[MMVetItem]:
    """Read ``mm-vet.json`` (a dict keyed ``v1_0``..); image names resolve under ``image_root``
    (default: the file's folder) by the data layer's path rule."""
    from mmtune.evaluation.common import load_json_or_jsonl, resolve_image

    data = load_json_or_jsonl(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected MM-Vet's dict keyed by question id (v1_0, v1_1, ...)")
    problems, items = [], []
    for key, value in data.items():
        missing = [k for k in ("question", "answer", "capability") if k not in value]
        if missing:
            problems.append(f"item {key}: missing {missing}")
            continue
        bad = [c for c in value["capability"] if c not in CAPABILITIES]
        if bad:
            problems.append(f"item {key}: unknown capability {bad}; known: {list(CAPABILITIES)}")
        image = value.get("imagename")
        if image:
            try:
                image = resolve_image(image, image_root, Path(path), allow_absolute=allow_absolute_image_paths)
            except ValueError as err:
                problems.append(f"item {key}: [path_outside_root] {err}")
        items.append(MMVetItem(key, value["question"], value["answer"], tuple(value["capability"]), image))
    if problems:
        raise ValueError(f"{path}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return items[:limit] if limit is not None else items


def capability_integration(capability: Sequence[str]) -> str:
    """The name of a capability set, in MM-Vet's canonical order (e.g. ``ocr_spat``)."""
    return "_".join(c for c in CAPABILITIES if c in capability)


_NUMBER = re.compile(r"^[\s\"'*]*(\d+(?:\.\d+)?|\.\d+)")


def parse_correctness(reply: Optional[str]) -> Optional[float]:
    """The score at the start of the reply, if it is a number in [0, 1]; else None.

    Like the official grader this reads the first token; it additionally tolerates
    quotes, bold markers and a trailing period ("**0.5**.").
    """
    if not reply:
        return None
    match = _NUMBER.match(reply)
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


def _judge_run(items, predictions, judge, template, cfg: MMVetConfig, run: int, progress: bool) -> list[ItemScore]:
    from mmtune.evaluation.judge import JudgeRequest

    scores: dict[str, ItemScore] = {}
    pending = [item for item in items if item.id in predictions]
    for item in items:
        if item.id not in predictions:
            scores[item.id] = ItemScore(item.id, run, 0.0, 0, "missing")
    for attempt in range(cfg.max_tries):
        if not pending:
            break
        temperature = 0.5 * attempt  # MM-Vet: raise the temperature by 0.5 per unparsable reply
        requests = [
            JudgeRequest(
                fill_prompt(template, question=item.question, answer=item.answer, prediction=str(predictions[item.id]).strip()),
                images=(item.image,) if item.image else (),
                temperature=temperature,
                max_tokens=16,
                run_index=run,
            )
            for item in pending
        ]
        replies = judge.judge_many(requests, progress=progress, desc=f"MM-Vet judge run {run} try {attempt + 1}")
        still = []
        for item, reply in zip(pending, replies):
            if not reply.ok:
                scores[item.id] = ItemScore(item.id, run, 0.0, attempt + 1, "failed")
                continue
            value = parse_correctness(reply.content)
            if value is None:
                still.append(item)
            else:
                scores[item.id] = ItemScore(item.id, run, value, attempt + 1, "ok")
        pending = still
    for item in pending:
        scores[item.id] = ItemScore(item.id, run, 0.0, cfg.max_tries, "unparsed")
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
    """Judge ``predictions`` (``{"v1_0": answer}``) ``cfg.runs`` times and aggregate."""
    template = load_prompt("mmvet_judge.txt", cfg.prompt_file, ("question", "answer", "prediction"))
    runs = [_judge_run(items, predictions, judge, template, cfg, r, progress) for r in range(cfg.runs)]
    cap_runs, int_runs = zip(*(_tables(items, r) for r in runs))
    metrics: dict[str, float] = {}
    for name in cap_runs[0]:
        metrics[name] = _mean_std([t[name] for t in cap_runs])[0]
    metrics["total"], metrics["total_std"] = _mean_std([t["total"] for t in cap_runs])
    for name in int_runs[0]:
        if name != "total":
            metrics[f"int/{name}"] = _mean_std([t[name] for t in int_runs])[0]
    flat = [s for r in runs for s in r]
    counts = {
        "items": len(items),
        "runs": cfg.runs,
        "missing": sum(s.status == "missing" for s in runs[0]),
        "unparsed": sum(s.status == "unparsed" for s in flat),
        "failed": sum(s.status == "failed" for s in flat),
        "retried": sum(s.tries > 1 for s in flat),
    }
    meta = {
        "run_totals": [t["total"] for t in cap_runs],
        "capability_runs": list(cap_runs),
        "integration_runs": list(int_runs),
        "judge_model": getattr(judge, "model", None),
        "prompt_file": cfg.prompt_file or "builtin:mmvet_judge.txt",
    }
    return BenchmarkResult(run, model, "mmvet", metrics, counts, meta, context_length), runs


def write_official_csvs(result: BenchmarkResult, out_dir: str, *, model: str) -> tuple[Path, Path]:
    """MM-Vet's two CSVs: capability scores and capability-integration scores.

    Layout as the official grader: one row per model; columns are the capabilities (or
    capability sets), then ``total``, ``std`` and ``runs`` (the per-run totals).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = result.meta["run_totals"]
    paths = []
    for kind, tables in (("cap-score", result.meta["capability_runs"]), ("cap-int-score", result.meta["integration_runs"])):
        names = [k for k in tables[0] if k != "total"]
        path = out / f"mmvet-{kind}-{len(runs)}runs.csv"
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["model", *names, "total", "std", "runs"])
            row = [model]
            for name in names:
                row.append(round(sum(t[name] for t in tables) / len(tables), 1))
            row += [round(result.metrics["total"], 1), round(result.metrics["total_std"], 1), str([round(r, 1) for r in runs])]
            writer.writerow(row)
        paths.append(path)
    return paths[0], paths[1]
