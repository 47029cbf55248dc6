"""Run the configured benchmarks on a model or on prediction files; write results and the report.

Entry points:

* :func:`evaluate_checkpoint` loads any saved checkpoint (or ``model_config``) and
  evaluates it (used by ``recipes/evaluate.py`` and callable at the end of training);
* :func:`evaluate_model` evaluates an already loaded model/adapter pair;
* both score a benchmark's ``predictions`` file instead of generating when it is set.

Output layout under ``output_dir``::

    generations/<benchmark>.jsonl   per-turn answers (resumable)
    judge_cache.sqlite              judge replies (resumable, never paid twice)
    <benchmark>[-ctx<N>].json       mmtune result (mmtune.evaluation.results schema)
    details/<benchmark>.jsonl       per-turn / per-item scores
    mmvet_results.json, mmvet-*.csv MM-Vet in the official formats
    report.md, *.png                tables and plots
    viewer.html                     every dialogue / item with its answers and scores (static page)
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.evaluation.config import EvalConfig, validate_eval_config
from mmtune.evaluation.results import BenchmarkResult, write_result
from mmtune.models.config import ModelConfig

__all__ = ["evaluate_checkpoint", "evaluate_model", "run_benchmarks"]

log = logging.getLogger(__name__)


def _write_details(out: Path, name: str, rows: list[Any]) -> None:
    path = out / "details" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(dataclasses.asdict(row) if dataclasses.is_dataclass(row) else row, ensure_ascii=False, default=str) + "\n")


class _Context:
    """Lazily built shared pieces: the generator (loads the model) and the judge client."""

    def __init__(self, cfg: EvalConfig, out: Path, make_generator: Optional[Callable[[], Any]]):
        self.cfg, self.out, self._make_generator = cfg, out, make_generator
        self._generator = None
        self._judge = None

    @property
    def generator(self):
        if self._generator is None:
            if self._make_generator is None:
                raise ValueError(
                    "a benchmark needs generation but no model was given: set `checkpoint` / `model.path`, or set "
                    "the benchmark's `predictions` file to score existing answers"
                )
            self._generator = self._make_generator()
        return self._generator

    @property
    def judge(self):
        if self._judge is None:
            from mmtune.evaluation.judge import JudgeClient

            judge_cfg = self.cfg.judge
            cache = judge_cfg.cache_path or str(self.out / "judge_cache.sqlite")
            self._judge = JudgeClient(judge_cfg, cache_path=cache)
        return self._judge

    def generate(self, name: str, dialogues: list[Dialogue]):
        return self.generator.generate(dialogues, out_path=self.out / "generations" / f"{name}.jsonl", progress=self.cfg.progress)

    def close(self) -> None:
        if self._judge is not None:
            self._judge.close()


def _turn_predictions(records) -> dict:
    from mmtune.evaluation.common import TurnPrediction

    return {(r.dialogue_id, r.turn): TurnPrediction(r.answer, {"finish_reason": r.finish_reason, "context": r.context})
            for r in records if r.answer is not None}


def _run_synthetic_or_mmdu(name: str, ctx: _Context, run: str, model: str, context_length: Optional[int]) -> BenchmarkResult:
    from mmtune.evaluation.common import load_mmdu_dialogues, load_turn_predictions

    sub = getattr(ctx.cfg, name)
    if not sub.data_path:
        raise ValueError(f"eval.{name}.data_path is required: it holds the questions and reference answers")
    dialogues = load_mmdu_dialogues(sub.data_path, image_root=sub.image_root, source=name, limit=sub.limit)
    if sub.predictions:
        predictions = load_turn_predictions(sub.predictions)
    else:
        predictions = _turn_predictions(ctx.generate(name, dialogues))
    if name == "synthetic":
        from mmtune.evaluation.synthetic import score_synthetic

        result, rows = score_synthetic(dialogues, predictions, run=run, model=model, context_length=context_length)
    else:
        from mmtune.evaluation.mmdu import score_mmdu

        result, rows = score_mmdu(dialogues, predictions, ctx.judge, sub, run=run, model=model,
                                  context_length=context_length, progress=ctx.cfg.progress)
    _write_details(ctx.out, result.benchmark, rows)
    return result


def _run_mmvet(ctx: _Context, run: str, model: str, context_length: Optional[int]) -> BenchmarkResult:
    from mmtune.evaluation.common import load_json_or_jsonl
    from mmtune.evaluation.mmvet import load_items, score_mmvet, write_official_csvs

    sub = ctx.cfg.mmvet
    if not sub.data_path:
        raise ValueError("eval.mmvet.data_path is required: mm-vet.json holds the questions and ground truths")
    items = load_items(sub.data_path, image_root=sub.image_root, limit=sub.limit)
    if sub.predictions:
        predictions = load_json_or_jsonl(sub.predictions)
        if not isinstance(predictions, dict):
            raise ValueError(f"{sub.predictions}: expected MM-Vet's results JSON {{\"v1_0\": \"answer\", ...}}")
    else:
        dialogues = [Dialogue(i.id, "mmvet", (Turn("user", ((Image(i.image), "\n") if i.image else ()) + (i.question,)),))
                     for i in items]
        predictions = {r.dialogue_id: r.answer or "" for r in ctx.generate("mmvet", dialogues)}
        (ctx.out / "mmvet_results.json").write_text(json.dumps(predictions, indent=2, ensure_ascii=False))
    result, runs = score_mmvet(items, predictions, ctx.judge, sub, run=run, model=model,
                               context_length=context_length, progress=ctx.cfg.progress)
    write_official_csvs(result, str(ctx.out), model=model)
    _write_details(ctx.out, "mmvet", [s for r in runs for s in r])
    return result


def _run_mdi(ctx: _Context, run: str, model: str, context_length: Optional[int]) -> BenchmarkResult:
    from mmtune.evaluation.mdi import build_prompt, load_items, score_mdi

    sub = ctx.cfg.mdi
    source = sub.predictions or sub.data_path
    if not source:
        raise ValueError("eval.mdi: set data_path (to generate) or predictions (items with a 'response')")
    items = load_items(source, image_root=sub.image_root, limit=sub.limit)
    if sub.predictions:
        missing = [i.id for i in items if i.response is None]
        if missing:
            raise ValueError(f"{sub.predictions}: items {missing[:10]} have no 'response' field")
        responses = {i.id: i.response for i in items}
    else:
        dialogues = [Dialogue(i.id, "mdi", (Turn("user", ((Image(i.image), "\n") if i.image else ()) + (build_prompt(i),)),))
                     for i in items]
        responses = {r.dialogue_id: r.answer for r in ctx.generate("mdi", dialogues) if r.answer is not None}
    result, rows = score_mdi(items, responses, alpha=sub.alpha, run=run, model=model, context_length=context_length)
    _write_details(ctx.out, "mdi", rows)
    return result


def run_benchmarks(
    cfg: EvalConfig,
    *,
    output_dir: str,
    run_name: str,
    model_label: str,
    make_generator: Optional[Callable[[], Any]] = None,
    checkpoint: Optional[str] = None,
    family: Optional[str] = None,
    wandb_run: Any = None,
) -> dict[str, BenchmarkResult]:
    """Run ``cfg.benchmarks``; write one result JSON each, details and the report.

    Args:
        make_generator: builds the :class:`DialogueGenerator` on first need (not called
            when every benchmark scores a predictions file).
        checkpoint, family: the exported HF directory and model family, for lmms-eval.
        wandb_run: an active W&B run to log metrics and plots to (or None).

    Returns:
        ``{benchmark: result}`` (lmms-eval adds one entry per task).
    """
    validate_eval_config(cfg)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctx = _Context(cfg, out, make_generator)
    context_length = cfg.generation.context_length
    results: dict[str, BenchmarkResult] = {}
    try:
        for name in cfg.benchmarks:
            if name in ("synthetic", "mmdu"):
                found = [_run_synthetic_or_mmdu(name, ctx, run_name, model_label, context_length)]
            elif name == "mmvet":
                found = [_run_mmvet(ctx, run_name, model_label, context_length)]
            elif name == "mdi":
                found = [_run_mdi(ctx, run_name, model_label, context_length)]
            else:
                from mmtune.evaluation.lmms_eval import run_lmms_eval

                if not checkpoint and not cfg.lmms_eval.results_path:
                    raise ValueError("lmms_eval needs an exported checkpoint directory (`checkpoint`) or eval.lmms_eval.results_path")
                found = run_lmms_eval(checkpoint or "", cfg.lmms_eval, family=family or "llava",
                                      output_path=str(out / "lmms_eval"), run=run_name, model=model_label)
            for result in found:
                if ctx._judge is not None and result.benchmark in ("mmdu", "mmvet"):
                    result.meta["judge_stats"] = ctx._judge.stats.to_dict()
                if ctx._generator is not None and result.benchmark in ("synthetic", "mmdu", "mmvet", "mdi"):
                    result.meta["generation"] = dataclasses.asdict(cfg.generation)
                    # the window actually applied (the model's own when context_length is null)
                    result.meta["context_window"] = ctx._generator.context_length
                write_result(result, out)
                results[result.benchmark] = result
                log.info("%s: %s", result.benchmark, {k: round(v, 2) for k, v in result.metrics.items() if "/" not in k})
    finally:
        ctx.close()
    plots = []
    if cfg.report and results:
        from mmtune.evaluation.report import write_report

        _, plots = write_report(list(results.values()), out, title=f"Evaluation of {run_name}")
        from mmtune.evaluation.viewer import write_viewer

        write_viewer(cfg, out, title=f"Answers of {run_name}")
    if wandb_run is not None:
        flat = {f"eval/{b}/{k}": v for b, r in results.items() for k, v in r.metrics.items()}
        import wandb

        flat.update({f"eval/plots/{p.stem}": wandb.Image(str(p)) for p in plots})
        wandb_run.log(flat)
    return results


def evaluate_model(
    model: Any,
    adapter: Any,
    cfg: EvalConfig,
    *,
    output_dir: str,
    run_name: str,
    model_label: str = "model",
    checkpoint: Optional[str] = None,
    wandb_run: Any = None,
) -> dict[str, BenchmarkResult]:
    """Evaluate an already loaded ``model`` (e.g. at the end of training) with ``cfg``."""
    from mmtune.evaluation.generation import DialogueGenerator

    was_training = getattr(model, "training", False)
    try:
        return run_benchmarks(
            cfg, output_dir=output_dir, run_name=run_name, model_label=model_label,
            make_generator=lambda: DialogueGenerator(adapter, model, cfg.generation),
            checkpoint=checkpoint, family=getattr(adapter, "family", None), wandb_run=wandb_run,
        )
    finally:
        model.train(was_training)  # the trainer may continue after a mid-run evaluation


def evaluate_checkpoint(
    checkpoint: Optional[str],
    cfg: Optional[EvalConfig] = None,
    *,
    output_dir: str,
    run_name: str = "eval",
    model_config: Optional[ModelConfig] = None,
    wandb: bool = False,
    wandb_project: str = "mmtune",
) -> dict[str, BenchmarkResult]:
    """Load ``checkpoint`` (a run dir, ``final/``, a LoRA adapter dir or ``None`` for
    ``model_config``) only if a benchmark needs generation, then run ``cfg``'s benchmarks.

    Returns:
        ``{benchmark: BenchmarkResult}``; the files are under ``output_dir``.
    """
    from mmtune.evaluation.generation import DialogueGenerator
    from mmtune.evaluation.loading import load_for_evaluation, resolve_checkpoint

    cfg = cfg or EvalConfig()
    model_config = model_config or ModelConfig()
    family = model_config.family
    hf_dir = None
    if checkpoint:
        resolved, peft_dir = resolve_checkpoint(checkpoint, model_config)
        family = resolved.family
        hf_dir = resolved.path if peft_dir is None else None
        if peft_dir is not None and "lmms_eval" in cfg.benchmarks and not cfg.lmms_eval.results_path:
            raise ValueError(
                f"{checkpoint} is a LoRA adapter without merged weights; lmms-eval needs a full HF checkpoint. "
                "Evaluate the run's final/ saved with peft.merge_on_save=true, or merge the adapter with peft first"
            )
    label = checkpoint or model_config.path or f"random:{model_config.family}"

    def make_generator():
        adapter, model, _ = load_for_evaluation(checkpoint, model_config, device=cfg.generation.device)
        return DialogueGenerator(adapter, model, cfg.generation)

    wandb_run = None
    if wandb:
        import wandb as wandb_lib

        # only the eval settings: the judge's URL and key live in the environment, not here
        wandb_run = wandb_lib.init(project=wandb_project, name=run_name, job_type="eval",
                                   config={"eval": dataclasses.asdict(cfg), "checkpoint": checkpoint})
    try:
        return run_benchmarks(cfg, output_dir=output_dir, run_name=run_name, model_label=label,
                              make_generator=make_generator, checkpoint=hf_dir or checkpoint, family=family,
                              wandb_run=wandb_run)
    finally:
        if wandb_run is not None:
            wandb_run.finish()
