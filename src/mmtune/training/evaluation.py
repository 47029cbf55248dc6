"""Evaluation hooks of a training run: the ``eval`` benchmarks before training and on ``final/``.

A thin bridge to the evaluator (:func:`mmtune.evaluation.runner.evaluate_model`) on the
in-memory model, so the demo scores the model it just trained without reloading it.
Result files (``<output_dir>/eval/<before|after>/``) use the evaluator's schema.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from mmtune.models.base import ModelAdapter
    from mmtune.training.config import SFTConfig

__all__ = ["evaluate_in_training"]


def evaluate_in_training(model: "nn.Module", adapter: "ModelAdapter", cfg: "SFTConfig", *, tag: str, run: str,
                         output_dir: str, checkpoint: Optional[str] = None,
                         wandb_run: Any = None) -> dict[str, dict[str, float]]:
    """Run ``cfg.eval``'s benchmarks on ``model``; returns ``{benchmark: metrics}``."""
    from mmtune.evaluation.runner import evaluate_model

    results = evaluate_model(model, adapter, cfg.eval, output_dir=output_dir, run_name=run,
                             model_label=checkpoint or f"{run}@{tag}", checkpoint=checkpoint, wandb_run=wandb_run)
    return {name: dict(result.metrics) for name, result in results.items()}
