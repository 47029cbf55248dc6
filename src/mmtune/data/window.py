"""Which dialogues exceed the training window, with and without sequence parallelism.

The window is one row: ``collator.max_length`` tokens (``context.max_length`` when a context
extension sets it), template and image tokens included. With
``training.sequence_parallel.size = N`` that row is split over ``N`` GPUs, so each GPU holds
``ceil(max_length / N)`` tokens of it through the decoder; without sequence parallelism a GPU
holding that many tokens would train rows of that length only. :func:`window_report` measures
every dialogue exactly as training's length pass does (:mod:`mmtune.data.lengths`) and
counts both: the dialogues longer than a GPU's share (what sequence parallelism buys) and
the dialogues longer than the whole row, which ``collator.truncation`` truncates, skips or
refuses even with sequence parallelism.

Example::

    report = window_report(adapter, mixture, max_length=32768, truncation="skip_sample", sequence_parallel=4)
    print(report.render())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.mixture import Mixture
    from mmtune.models.base import ModelAdapter

__all__ = ["LongDialogue", "WindowReport", "too_long_action", "window_report"]


@dataclass(frozen=True)
class LongDialogue:
    """One dialogue longer than a window."""

    source: str
    path: str
    """The data file it was read from."""
    dialogue_id: str
    length: int
    """Tokens of the whole dialogue (template and image tokens included)."""
    kept: int
    """Tokens training keeps after ``collator.truncation`` (0: skipped or refused)."""

    def describe(self) -> str:
        return f"{self.path} record {self.dialogue_id!r} ({self.length} tokens)"


def too_long_action(truncation: str, kept: int) -> str:
    """What training does with a dialogue longer than the ``max_length``-token row."""
    if truncation == "error":
        return "refused: training stops at start-up naming it (collator.truncation=error)"
    if truncation == "skip_sample" or kept == 0:
        why = "" if truncation == "skip_sample" else ", its first exchange alone is longer"
        return f"skipped (collator.truncation={truncation}{why})"
    return f"truncated to {kept} tokens, trailing exchanges dropped (collator.truncation={truncation})"


@dataclass
class WindowReport:
    """Dialogues against the window, with and without sequence parallelism (see the module docstring)."""

    max_length: int
    """Tokens of one row (``collator.max_length`` / ``context.max_length``)."""
    sequence_parallel: int
    """``training.sequence_parallel.size``."""
    truncation: str
    """``collator.truncation``."""
    samples: int = 0
    """Dialogues measured (image refusals excluded)."""
    longest: Optional[LongDialogue] = None
    over_gpu: int = 0
    """Dialogues longer than a GPU's share of the row (``per_gpu``)."""
    over_gpu_examples: list[LongDialogue] = field(default_factory=list)
    over_row: list[LongDialogue] = field(default_factory=list)
    """Every dialogue longer than the whole row."""

    @property
    def per_gpu(self) -> int:
        """Tokens of a row each GPU holds through the decoder."""
        return -(-self.max_length // self.sequence_parallel)

    def render(self, examples: int = 5) -> str:
        n = self.sequence_parallel
        lines = [f"window: collator.max_length={self.max_length} tokens per row, training.sequence_parallel.size={n}"
                 + (f" ({self.per_gpu} tokens of each row per GPU)" if n > 1 else "")
                 + f", collator.truncation={self.truncation}"]
        if self.longest is not None:
            lines.append(f"  longest dialogue: {self.longest.describe()}")
        if n > 1:
            named = "".join(f"\n      {d.describe()}" for d in self.over_gpu_examples[:examples])
            lines.append(f"  without sequence parallelism ({self.per_gpu}-token rows, a GPU's share): "
                         f"{self.over_gpu} of {self.samples} dialogue(s) longer" + (", e.g." if named else "") + named)
        head = (f"with sequence parallelism over {n} GPUs ({self.max_length}-token rows)" if n > 1
                else f"{self.max_length}-token rows")
        lines.append(f"  {head}: {len(self.over_row)} of {self.samples} dialogue(s) longer"
                     + (", each:" if self.over_row else ""))
        for d in self.over_row[:examples]:
            lines.append(f"      {d.describe()}: {too_long_action(self.truncation, d.kept)}")
        if len(self.over_row) > examples:
            lines.append(f"      ... and {len(self.over_row) - examples} more")
        if self.over_row and self.longest is not None:
            # a power of two: what divides a node's GPUs and the models' head counts
            need = 1 << (-(-self.longest.length // self.per_gpu) - 1).bit_length()
            lines.append(f"  to train the longest whole at {self.per_gpu} tokens per GPU: "
                         f"training.sequence_parallel.size={need} with collator.max_length={need * self.per_gpu} "
                         "(the size must divide the launched GPUs and the model's attention and key/value heads)")
        return "\n".join(lines)

    @property
    def skipped(self) -> int:
        """Dialogues training leaves out for their length (refused ones included)."""
        return sum(1 for d in self.over_row if d.kept == 0 or self.truncation == "error")


def window_report(adapter: "ModelAdapter", mixture: "Mixture", *, max_length: int, truncation: str,
                  train_on: str = "all_assistant", system_prompt: Optional[str] = None, sequence_parallel: int = 1,
                  cache_dir: Optional[str] = None, image_errors: str = "skip") -> WindowReport:
    """Measure every dialogue of ``mixture`` as training does and compare it with the window.

    Args:
        adapter: the model's adapter (tokenizer, template, image token counts).
        mixture: the loaded sources.
        max_length: tokens of one row; truncation, train_on, system_prompt: the ``collator`` settings.
        sequence_parallel: ``training.sequence_parallel.size``.
        cache_dir: the length cache (``collator.length_cache_dir``), shared with training.
        image_errors: what an image the adapter cannot count does (``skip``: left out of the counts).
    """
    from mmtune.data.loss_report import lengths_per_source

    # "error" would stop at the first long dialogue; measured as skip_sample, every one is named
    measured = "skip_sample" if truncation == "error" else truncation
    _, tables = lengths_per_source(adapter, mixture, max_length=max_length, truncation=measured, train_on=train_on,
                                   system_prompt=system_prompt, cache_dir=cache_dir, image_errors=image_errors)
    report = WindowReport(max_length, max(1, int(sequence_parallel)), truncation)
    share = report.per_gpu
    for source, table in zip(mixture.sources, tables):
        refused = {int(item["index"]) for item in table.image_skipped}
        full = np.asarray(table.full_lengths)

        def long(i: int) -> LongDialogue:
            return LongDialogue(source.name, source.config.path, source.dialogues[i].id, int(full[i]),
                                int(table.lengths[i]))

        usable = np.array([i not in refused for i in range(len(full))], dtype=bool)
        report.samples += int(usable.sum())
        if usable.any():
            top = int(np.flatnonzero(usable)[np.argmax(full[usable])])
            if report.longest is None or full[top] > report.longest.length:
                report.longest = long(top)
        over_gpu = np.flatnonzero(usable & (full > share))
        report.over_gpu += len(over_gpu)
        report.over_gpu_examples += [long(int(i)) for i in over_gpu[:5]]
        report.over_row += [long(int(i)) for i in np.flatnonzero(usable & (full > max_length))]
    report.over_gpu_examples = report.over_gpu_examples[:5]
    return report
