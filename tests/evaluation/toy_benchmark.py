"""A benchmark that lives outside mmtune: this module and ``configs/eval/toy.yaml`` are all of it.

"toy" scores whether each answer contains its reference (case-insensitive unless
``case_sensitive``), on MMDU-schema dialogues such as the synthetic held-out split. Importing the module registers it; the
config section ``eval.toy``, the runner, ``report.md``, ``viewer.html``, ``mmtune plan`` and
``mmtune evaluate score|checkpoint toy`` then know it without an edit anywhere else
(``tests/evaluation/test_toy_benchmark.py`` checks each).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mmtune.evaluation.benchmarks.base import DialogueBenchmark
from mmtune.evaluation.benchmarks.registry import register
from mmtune.evaluation.benchmarks.synthetic import SyntheticConfig
from mmtune.evaluation.results import BenchmarkResult

CONFIGS = Path(__file__).parent / "configs"


@dataclass
class ToyConfig(SyntheticConfig):
    """The synthetic benchmark's settings (the toy reads the same kind of file), plus its own."""

    case_sensitive: bool = False
    """Compare answer and reference as they are (default: lower-cased)."""


@register
class ToyBenchmark(DialogueBenchmark):
    """Toy: does each answer contain its reference?"""

    name = "toy"
    settings_class = ToyConfig
    config_root = str(CONFIGS)
    viewer_scale = "% of answers containing the reference"

    def score(self, items, predictions, ctx, sub) -> tuple[BenchmarkResult, list[dict[str, Any]]]:
        rows = []
        for dialogue in items:
            for t, (_, a) in enumerate(dialogue.exchanges()):
                prediction = predictions.get((dialogue.id, t))
                answer, reference = (prediction.answer if prediction else None), dialogue.turns[a].text
                if answer is not None and not sub.case_sensitive:
                    answer, reference = answer.lower(), reference.lower()
                # detail rows number turns from 1, as data check, report.md and the viewer do
                rows.append({"dialogue_id": dialogue.id, "turn": t + 1, "answer": prediction.answer if prediction else None,
                             "hit": answer is not None and reference.strip() in answer})
        hits = sum(r["hit"] for r in rows)
        metrics = {"contains": 100.0 * hits / len(rows) if rows else float("nan")}
        counts = {"turns": len(rows), "dialogues": len(items), "hits": hits}
        return BenchmarkResult(ctx.run, ctx.model, self.name, metrics, counts, {}, ctx.context_length), rows

    def viewer_turn(self, turn: dict[str, Any], row: dict[str, Any]) -> None:
        turn["scores"] = {"hit": 1.0 if row.get("hit") else 0.0}
        turn["status"] = "hit" if row.get("hit") else "miss"

    def viewer_score(self, turns, rows) -> tuple[Optional[float], dict[str, Any]]:
        return (100.0 * sum(t["scores"]["hit"] for t in turns) / len(turns) if turns else None), {}
