"""The synthetic held-out split: exact match after normalisation, no judge.

Answers of the synthetic data are short and determined by the pixels (one word: a
colour, a shape, yes or no), so exact match is a sound score, and CI and the demo
evaluate without any server. What counts as correct is the data layer's rule,
:func:`mmtune.data.synthetic.is_correct` (equal after lower-casing, collapsing
whitespace and stripping surrounding punctuation), so the generator and the benchmark
cannot disagree. Metric ``exact_match`` in percent, plus one value per
turn (``turn/<i>``, the question/answer exchange from 1, as every report numbers turns)
to show whether later turns degrade.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.data.dialogue import Dialogue
from mmtune.data.synthetic import is_correct
from mmtune.evaluation.benchmarks.base import DialogueBenchmark
from mmtune.evaluation.benchmarks.common import TurnPrediction
from mmtune.evaluation.benchmarks.registry import register
from mmtune.evaluation.results import BenchmarkResult

__all__ = ["SyntheticConfig", "score_synthetic", "SyntheticBenchmark"]


@dataclass
class SyntheticConfig:
    data_path: Optional[str] = None
    """Held-out split in MMDU benchmark schema (written by the data generator)."""
    image_root: Optional[str] = None
    """Directory the image paths are relative to (``None``: paths are absolute or relative to the file)."""
    predictions: Optional[str] = None
    """Score this file instead of generating (same forms as MMDU)."""
    limit: Optional[int] = None
    """Evaluate only the first N dialogues."""


def score_synthetic(
    dialogues: Sequence[Dialogue],
    predictions: dict[tuple[str, int], TurnPrediction],
    *,
    run: str,
    model: str,
    context_length: Optional[int] = None,
    benchmark: str = "synthetic",
) -> tuple[BenchmarkResult, list[dict[str, Any]]]:
    """Exact match of every (dialogue, exchange); a missing answer counts as wrong.

    ``predictions`` are keyed by the exchange's position (0 = first question); the detail
    rows and ``turn/<i>`` number turns from 1. ``benchmark`` names the result."""
    records = []
    for dialogue in dialogues:
        for t, (_, a) in enumerate(dialogue.exchanges()):
            prediction = predictions.get((dialogue.id, t))
            reference = dialogue.turns[a].text
            answer = prediction.answer if prediction is not None else None
            records.append(
                {"dialogue_id": dialogue.id, "turn": t + 1, "reference": reference, "answer": answer,
                 "correct": answer is not None and is_correct(answer, reference)}
            )
    metrics = {"exact_match": 100.0 * sum(r["correct"] for r in records) / len(records) if records else float("nan")}
    by_turn: dict[int, list[bool]] = {}
    for r in records:
        by_turn.setdefault(r["turn"], []).append(r["correct"])
    for t, values in sorted(by_turn.items()):
        metrics[f"turn/{t}"] = 100.0 * sum(values) / len(values)
    counts = {
        "turns": len(records),
        "dialogues": len(dialogues),
        "correct": sum(r["correct"] for r in records),
        "missing": sum(r["answer"] is None for r in records),
    }
    meta = {"per_turn_index_n": {str(t): len(v) for t, v in sorted(by_turn.items())}}
    return BenchmarkResult(run, model, benchmark, metrics, counts, meta, context_length), records


@register
class SyntheticBenchmark(DialogueBenchmark):
    """Exact match on the synthetic held-out split (no judge)."""

    name = "synthetic"
    settings_class = SyntheticConfig
    title = "Synthetic"
    """How the report's plot names the benchmark."""

    def score(self, items, predictions, ctx, sub):
        return score_synthetic(items, predictions, run=ctx.run, model=ctx.model, context_length=ctx.context_length,
                               benchmark=self.name)

    viewer_scale = "% correct"

    def viewer_turn(self, turn: dict[str, Any], row: dict[str, Any]) -> None:
        correct = bool(row.get("correct"))
        turn["scores"] = {"correct": 1.0 if correct else 0.0}
        turn["status"] = "correct" if correct else ("missing" if turn["answer"] is None else "wrong")

    def viewer_score(self, turns: list[dict[str, Any]], rows: list[dict[str, Any]]) -> tuple[Optional[float], dict[str, Any]]:
        from mmtune.evaluation.reporting.viewer import finite_mean

        return finite_mean([100.0 * t["scores"]["correct"] for t in turns]), {}

    def report_section(self, result: BenchmarkResult, out: Path) -> tuple[list[str], list[Path]]:
        from mmtune.evaluation.reporting.plots import plot_line
        from mmtune.evaluation.reporting.report import markdown_table

        m = result.metrics
        turns = sorted(int(k.split("/")[1]) for k in m if k.startswith("turn/"))
        lines = [markdown_table(["metric", "value"], [["exact_match", m["exact_match"]]] + [[f"turn {t}", m[f"turn/{t}"]] for t in turns])]
        plots = []
        if turns:
            plots.append(plot_line(out / f"{self.name}_by_turn.png", f"{self.title} exact match by turn", turns,
                                    [m[f"turn/{t}"] for t in turns], "exact match (%)", ylim=(0, 100)))
        return lines, plots
