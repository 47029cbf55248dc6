"""The stop on a non-finite loss or gradient norm (``training.max_nonfinite_steps``).

A NaN or infinite loss, or a non-finite gradient norm, means the step's update would write
NaN into the weights: every later step trains on garbage while the run exits 0, and its
checkpoints and ``final/`` hold the poisoned weights. The loop asks one
:class:`NonFiniteGuard` three questions:

- at the step's gradient sync, :meth:`~NonFiniteGuard.allows_update`: a non-finite norm
  skips the optimizer update (engines that step inside ``backward``, DeepSpeed, have
  already applied it; the stop below still holds);
- after the step, :meth:`~NonFiniteGuard.observe`: a non-finite step is counted and said;
  once more than ``max_nonfinite_steps`` steps were non-finite, the run stops with
  :class:`NonFiniteTrainingError`, naming the step and its samples' ids;
- before any save, :meth:`~NonFiniteGuard.save_problem`: nothing is saved after a
  non-finite step, so the last checkpoint written stays the last good one.

Under fp16 the loss scaler skips every step whose gradients overflow and lowers its scale:
an infinite gradient norm with a finite loss is that normal event there, not counted.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

__all__ = ["NonFiniteGuard", "NonFiniteTrainingError"]


class NonFiniteTrainingError(RuntimeError):
    """More steps had a non-finite loss or gradient norm than ``training.max_nonfinite_steps`` allows."""


def _finite(value: Optional[float]) -> bool:
    return value is None or math.isfinite(value)


class NonFiniteGuard:
    """Counts the steps whose loss or gradient norm was not finite; stops the run past the limit.

    Args:
        max_steps: ``training.max_nonfinite_steps``: non-finite steps tolerated (0: stop at the first).
        loss_scaled: fp16 with a loss scaler, whose overflowing steps have an infinite norm by design.
    """

    def __init__(self, max_steps: int, *, loss_scaled: bool = False):
        self.max_steps = max_steps
        self.loss_scaled = loss_scaled
        self.steps: list[int] = []
        self.last_bad = False

    def _norm_bad(self, grad_norm: Optional[float]) -> bool:
        return not self.loss_scaled and not _finite(grad_norm)

    def allows_update(self, grad_norm: Optional[float]) -> bool:
        """Whether the optimizer may apply this step's gradients (their norm is finite)."""
        return not self._norm_bad(grad_norm)

    def observe(self, step: int, loss: float, grad_norm: Optional[float],
                sample_ids: Sequence[Sequence[str]]) -> Optional[str]:
        """Count step ``step``; a line to print when it was non-finite (``None`` when it was not).

        Args:
            sample_ids: the ids of the step's samples, per micro-batch (every rank's, gathered).

        Raises:
            NonFiniteTrainingError: this was non-finite step number ``max_steps + 1``.
        """
        self.last_bad = not _finite(loss) or self._norm_bad(grad_norm)
        if not self.last_bad:
            return None
        self.steps.append(step)
        ids = [i for batch in sample_ids for i in batch]
        shown = ", ".join(map(str, ids[:20])) + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")
        what = f"step {step}: loss {loss}, gradient norm {grad_norm} (samples: {shown or 'none'})"
        if len(self.steps) > self.max_steps:
            raise NonFiniteTrainingError(
                f"training stopped at a non-finite step, {what}; {len(self.steps)} non-finite step(s) so far "
                f"({', '.join(map(str, self.steps[:10]))}), above training.max_nonfinite_steps={self.max_steps}. "
                "Nothing was saved after a non-finite step: the last checkpoint of this run is from before it. "
                "How to fix: look at those samples (mmtune data check), lower training.lr or set "
                "training.max_grad_norm, check that the checkpoint resumed from is intact, then rerun with "
                "training.resume=auto")
        return (f"warning: non-finite {what}; its update was skipped where the engine allows "
                f"({len(self.steps)} of training.max_nonfinite_steps={self.max_steps} tolerated)")

    def check_step(self, accelerator: Any, step: int, loss: float, grad_norm: Optional[float],
                   sample_ids: list[list[str]]) -> None:
        """:meth:`observe` step ``step`` on every rank at once, with the step's ids from every rank
        where it was non-finite (the loss and norm are the same on every rank); its line printed."""
        if accelerator.num_processes > 1 and not (_finite(loss) and self.allows_update(grad_norm)):
            from accelerate.utils import gather_object

            sample_ids = [batch for rank in gather_object([sample_ids]) for batch in rank]
        note = self.observe(step, loss, grad_norm, sample_ids)
        if note:
            accelerator.print(note)

    def save_problem(self) -> str:
        """Why nothing may be saved now (the last step was non-finite); empty when saving is fine."""
        if self.last_bad:
            return (f"not saved: step {self.steps[-1]} had a non-finite loss or gradient norm, and its state "
                    "would replace a good checkpoint")
        return ""
