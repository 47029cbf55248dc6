"""Evaluation hooks of a training run: the ``eval`` benchmarks before training and on ``final/``.

A thin bridge to the evaluator (:func:`mmtune.evaluation.runner.evaluate_model`) on the
in-memory model, so the demo scores the model it just trained without reloading it.
Result files (``<output_dir>/eval/<before|after>/``) use the evaluator's schema. Under
DDP or ZeRO-1/2 every rank calls it: each generates its share of the dialogues, the main
process scores and gets the results (the others get ``{}``). Under an engine that shards the
weights (FSDP2, ZeRO-3) on several processes each rank generates with the full weights the
engine gathers for it (:meth:`~mmtune.training.engines.base.Engine.evaluation_model`).

Those folders belong to the run: when one holds generations of other weights or data
(a re-run of the demo in the same folder, a resumed run whose model changed), they are
stale, so they are moved aside to ``generations/<name>.stale-<n>.jsonl`` and generated
again instead of being reported under the new model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from mmtune.models.base import ModelAdapter
    from mmtune.training.config import SFTConfig

__all__ = ["evaluate_in_training", "evaluate_and_log"]


def evaluate_in_training(model: "nn.Module", adapter: "ModelAdapter", cfg: "SFTConfig", *, tag: str, run: str,
                         output_dir: str, checkpoint: Optional[str] = None,
                         wandb_run: Any = None) -> dict[str, dict[str, float]]:
    """Run ``cfg.eval``'s benchmarks on ``model``; returns ``{benchmark: metrics}`` (``{}`` on
    the ranks other than the main process of a data-parallel run)."""
    import logging

    from mmtune.evaluation.generation.data_parallel import current_layout, lock_run_folder
    from mmtune.evaluation.generation.generator import StaleGenerationsError
    from mmtune.evaluation.runner import evaluate_model

    layout = current_layout()
    # Held across the retries, so nobody else writes between moving stale answers aside and
    # generating again. The run's own folder lock is another folder's (re-entrant if the same).
    with lock_run_folder(output_dir, layout, purpose=f"evaluation during training ({tag})",
                         hint="this folder belongs to a training run; evaluate into another folder"):
        for _ in range(len(cfg.eval.benchmarks) + 1):
            try:
                results = evaluate_model(model, adapter, cfg.eval, output_dir=output_dir, run_name=run,
                                         model_label=checkpoint or f"{run}@{tag}", checkpoint=checkpoint,
                                         wandb_run=wandb_run, layout=layout)
                break
            except StaleGenerationsError as err:  # every rank of a data-parallel run gets it: the main one moves it
                if layout.is_main:
                    moved = _move_aside(err.path)
                    logging.getLogger(__name__).warning("%s; this run's folder: moved the old answers to %s", err,
                                                        moved)
                layout.barrier()
        else:  # pragma: no cover - every benchmark's file was moved once
            raise RuntimeError(f"generations under {output_dir} stayed stale after moving them aside")
    return {name: dict(result.metrics) for name, result in results.items()}


def evaluate_and_log(recipe: Any, *, tag: str, checkpoint: Optional[str] = None) -> dict[str, dict[str, float]]:
    """Evaluate a running recipe's current model (``before`` / ``after``) and log the scores: every rank
    generates its share of the dialogues, the main process scores, logs and prints them."""
    acc = recipe.accelerator
    # the engine's model for generating alone on each rank (a gathered copy where it shards the weights)
    with recipe.engine.evaluation_model(recipe.model) as model:
        results = evaluate_in_training(model, recipe.adapter, recipe.cfg, tag=tag, run=recipe.run_name,
                                       output_dir=str(recipe.output_dir / "eval" / tag), checkpoint=checkpoint,
                                       wandb_run=recipe.logger.wandb_run if acc.is_main_process else None)
    if acc.is_main_process:
        flat = {f"eval_{tag}/{bench}/{name}": value for bench, metrics in results.items()
                for name, value in metrics.items()}
        recipe.logger.summary(flat)
        acc.print(f"eval ({tag}): " + ", ".join(f"{k.split('/', 1)[1]}={v:.2f}" for k, v in flat.items()
                                                if isinstance(v, (int, float))))
    acc.wait_for_everyone()
    return results


def _move_aside(path):
    """Rename a stale generation file and its settings file; returns the new file name."""
    from pathlib import Path

    path = Path(path)
    n = 1
    while path.with_name(f"{path.stem}.stale-{n}.jsonl").exists():
        n += 1
    target = path.with_name(f"{path.stem}.stale-{n}.jsonl")
    path.rename(target)
    settings = path.with_suffix(".settings.json")
    if settings.exists():
        settings.rename(target.with_suffix(".settings.json"))
    return target
