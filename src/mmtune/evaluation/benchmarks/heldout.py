"""Your own held-out dialogues, in any format mmtune trains on, scored by exact match (no judge).

The benchmark of a run on your own data: the file is read by the data layer as
training reads its files (llava, mmdu, xcomposer2 or messages, detected from the first
records as ``mmtune data check FILE`` does; ``format`` overrides), every user turn is
asked with the model's own earlier answers in the history, and each answer is compared
with the reference by the synthetic benchmark's rule (equal after lower-casing,
collapsing whitespace and stripping surrounding punctuation). Exact match suits short
answers (a label, a word, a number); for free-form answers write the held-out file in
MMDU schema and score it with ``mmdu`` and a judge.

Metric ``exact_match`` in percent and ``turn/<i>`` per turn, from 1, as ``synthetic``.
A held-out record that would be skipped (a missing image, a broken turn) stops the
evaluation with the data layer's report, so the score is never over fewer dialogues
than the file holds without saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mmtune.evaluation.benchmarks.registry import register
from mmtune.evaluation.benchmarks.synthetic import SyntheticBenchmark

__all__ = ["HeldoutConfig", "HeldoutBenchmark"]


@dataclass
class HeldoutConfig:
    data_path: Optional[str] = None
    """Your held-out dialogues: a JSON list or JSONL file in any format mmtune trains on
    (llava, mmdu, xcomposer2, messages), detected as ``mmtune data check FILE`` does."""
    image_root: Optional[str] = None
    """Folder the file's image paths are relative to and must stay inside (``None``: the file's folder)."""
    format: Optional[str] = None
    """The file's format, when detection should not decide (llava, mmdu, xcomposer2, messages)."""
    predictions: Optional[str] = None
    """Score this file of answers instead of generating (an mmtune generations JSONL, or the
    dialogues in MMDU schema with the model's answers in the assistant turns)."""
    limit: Optional[int] = None
    """Evaluate only the first N dialogues."""


@register
class HeldoutBenchmark(SyntheticBenchmark):
    """Exact match on your own held-out dialogues, any data format (no judge)."""

    name = "heldout"
    settings_class = HeldoutConfig
    title = "Held-out"

    def check(self, cfg: Any) -> list[str]:
        from mmtune.data.formats import format_names

        problems = super().check(cfg)
        fmt = self.settings(cfg).format
        if fmt is not None and fmt not in format_names():
            problems.append(f"eval.{self.name}.format={fmt!r} is unknown: use one of {', '.join(format_names())} "
                            "(or null: detected)")
        return problems

    def source_config(self, sub: Any) -> Any:
        """The file as one data-layer source, its format given or detected.

        Raises:
            ValueError: the file is missing or of no known format (the message says why).
        """
        from mmtune.data.files import sources_from_files

        (source,), _ = sources_from_files([sub.data_path], sub.image_root, key=f"eval.{self.name}.data_path",
                                          fmt=sub.format)
        source.name = f"eval_{self.name}"
        return source

    def read_dialogues(self, sub: Any, *, allow_absolute_image_paths: bool = False, check_images: str = "none",
                       image_limits: Any = None) -> list[Any]:
        """Every dialogue of the file (its first ``limit``), read and checked by the data layer
        (image files at least exist; ``check_images="verify"`` also opens each header and
        holds it to ``image_limits``).

        Raises:
            ValueError: a record would be skipped; the message holds the data layer's report.
        """
        from mmtune.data.readers import load_source

        loaded = load_source(self.source_config(sub), mode="skip",
                             check_images="verify" if check_images == "verify" else "exists",
                             allow_absolute_image_paths=allow_absolute_image_paths, image_limits=image_limits)
        report = loaded.report
        if report.records_skipped:
            from mmtune.evaluation.benchmarks.common import BenchmarkDataError

            raise BenchmarkDataError(f"eval.{self.name}.data_path={sub.data_path!r}: {report.records_skipped} of "
                             f"{report.records_read} held-out dialogue(s) cannot be evaluated; fix them "
                             f"(`mmtune data check {sub.data_path}` lists each):\n{report.render()}")
        dialogues = list(loaded.dialogues)
        return dialogues[: sub.limit] if sub.limit is not None else dialogues
