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
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from mmtune.evaluation.benchmarks.base import RunContext
from mmtune.evaluation.benchmarks.registry import get_benchmark
from mmtune.evaluation.config import EvalConfig, validate_eval_config
from mmtune.evaluation.results import BenchmarkResult, write_result
from mmtune.models.config import ModelConfig

__all__ = ["evaluate_checkpoint", "evaluate_model", "run_benchmarks", "collect_entries", "baseline_folder"]

log = logging.getLogger(__name__)


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
    model_config: Optional[ModelConfig] = None,
    lmms_pretrained: Optional[str] = None,
    lmms_is_adapter: bool = False,
    command_runner: Optional[Callable[..., Any]] = None,
    layout: Any = None,
    messages: Callable[[str], str] = str,
) -> dict[str, BenchmarkResult]:
    """Run ``cfg.benchmarks``; write one result JSON each, details and the report.

    Every benchmark is checked before any of them runs, so a run that cannot finish
    refuses at start-up. ``output_dir`` is locked for the run
    (:func:`~mmtune.evaluation.generation.data_parallel.lock_run_folder`): a second
    evaluation writing into it is refused with the holder's details instead of appending
    to the same files. Judge failures above ``eval.judge.max_failed_share``, and judge
    replies without a usable score above ``eval.judge.max_unparsed_share``, raise
    :class:`~mmtune.evaluation.judge.client.JudgeFailures`, and a served model's failed
    turns above ``eval.generation.api.max_failed_share``
    :class:`~mmtune.evaluation.generation.records.GenerationFailures`, after that
    benchmark's results, details and the report are written.

    Launched with several processes, every rank first generates its share of every
    benchmark (:mod:`mmtune.evaluation.generation.data_parallel`); then rank 0 alone
    scores, judges and writes the results (the other ranks return ``{}``), so each answer
    is judged once.

    Args:
        make_generator: builds the :class:`DialogueGenerator` on first need (not called
            when every benchmark scores a predictions file).
        checkpoint, family: the evaluated directory and model family.
        model_config: how the model is loaded (lmms-eval's ``mmtune`` model loads it the same way).
        lmms_pretrained: what lmms-eval loads (defaults to ``checkpoint``).
        command_runner: runs external commands (``subprocess.run``); dry runs record them instead.
        wandb_run: an active W&B run to log metrics and plots to (or None).
        layout: this process's place in a data-parallel run; ``None``: from the launcher's
            environment (:func:`~mmtune.evaluation.generation.data_parallel.current_layout`).
        messages: rewrites what is printed for the user (the evaluate CLI names its own
            flags instead of config keys); errors raised are the caller's to rewrite.

    Returns:
        ``{benchmark: result}`` (lmms-eval adds one entry per task).
    """
    from mmtune.evaluation.generation.data_parallel import current_layout, lock_run_folder
    from mmtune.io.secrets import redact

    validate_eval_config(cfg)
    layout = layout or current_layout()
    out = Path(output_dir)
    with lock_run_folder(out, layout, purpose="evaluation", hint=OUTPUT_HINT):
        # labels written into every result, report and W&B run: an interpolated key must not show
        run_name, model_label = redact([run_name, model_label], names=[cfg.judge.api_key_env])
        return _run_benchmarks(cfg, out, run_name=run_name, model_label=model_label, make_generator=make_generator,
                               checkpoint=checkpoint, family=family, wandb_run=wandb_run, model_config=model_config,
                               lmms_pretrained=lmms_pretrained, lmms_is_adapter=lmms_is_adapter,
                               command_runner=command_runner, layout=layout, messages=messages)


OUTPUT_HINT = ("give this evaluation another output folder (output_dir in recipes/evaluate.py, --out in mmtune "
               "evaluate; each checkpoint gets its own by default)")


def _run_benchmarks(cfg: EvalConfig, out: Path, *, run_name: str, model_label: str,
                    make_generator: Optional[Callable[[], Any]], checkpoint: Optional[str], family: Optional[str],
                    wandb_run: Any, model_config: Optional[ModelConfig], lmms_pretrained: Optional[str],
                    lmms_is_adapter: bool, command_runner: Optional[Callable[..., Any]], layout: Any,
                    messages: Callable[[str], str]) -> dict[str, BenchmarkResult]:
    from mmtune.evaluation.generation.data_parallel import check_layout

    ctx = RunContext(cfg, out, make_generator, run=run_name, model=model_label, checkpoint=checkpoint, family=family,
                     model_config=model_config, lmms_pretrained=lmms_pretrained or checkpoint,
                     lmms_is_adapter=lmms_is_adapter, command_runner=command_runner, layout=layout)
    benchmarks = [get_benchmark(name) for name in cfg.benchmarks]
    problems = [p for b in benchmarks for p in b.preflight(ctx)] + check_layout(cfg.generation, layout)
    if problems:
        raise ValueError("this evaluation cannot run to the end:\n  - " + "\n  - ".join(problems))
    if any(b.uses_judge for b in benchmarks) and layout.is_main:
        ctx.judge  # noqa: B018 - build the judge now: a missing model name fails before hours of generation, and the
        # start-up line says which endpoint and credentials source are used
        generating = [b for b in benchmarks if b.uses_judge and b.generates and not getattr(b.settings(cfg), "predictions", None)]
        if generating and cfg.judge.check_first:  # a wrong key or URL fails in seconds, before any answer is made
            ctx.judge.check()
    results: dict[str, BenchmarkResult] = {}
    sections: dict[str, Any] = {}
    try:
        if layout.distributed:  # every rank its share of every benchmark first: no rank waits while rank 0 judges
            for bench in benchmarks:
                dialogues = bench.pending_dialogues(ctx)
                if dialogues:
                    ctx.generate(bench.name, dialogues)
            if not layout.is_main:
                return results
        for bench in benchmarks:
            for result in bench.evaluate(ctx):
                if bench.uses_judge and ctx.has_judge:
                    result.meta["judge_stats"] = ctx.judge.stats.to_dict()
                if bench.generates and ctx.has_generator:
                    result.meta["generation"] = dataclasses.asdict(cfg.generation)
                    # the window actually applied (the model's own when context_length is null)
                    result.meta["context_window"] = ctx.generator.context_length
                    if getattr(ctx.generator, "batch_note", None):  # the batch run, and why it is not the configured one
                        result.meta["generation_batch_size"] = ctx.generator.batch_size
                        result.meta["generation_batch_note"] = ctx.generator.batch_note
                    if bench.name in ctx.generation_usage:
                        result.meta["generation_usage"] = ctx.generation_usage[bench.name]
                    if bench.name in ctx.rank_work:
                        result.meta["data_parallel"] = {"processes": layout.world_size,
                                                        "ranks": ctx.rank_work[bench.name]}
                write_result(result, out)
                results[result.benchmark] = result
                sections[result.benchmark] = bench
                log.info("%s: %s", result.benchmark, {k: round(v, 2) for k, v in result.metrics.items() if "/" not in k})
            ctx.check_generation(bench.name)
            if bench.uses_judge and ctx.has_judge:
                from mmtune.evaluation.judge.client import check_failures, check_unparsed

                stats = ctx.judge.stats
                check_failures(stats, cfg.judge, benchmark=bench.name)  # too many: raises, the summary in its message
                if stats.failed:  # failures within the allowed share: said once, here
                    print(messages(stats.summary()), file=sys.stderr, flush=True)
                for result in results.values():
                    if sections.get(result.benchmark) is bench:
                        check_unparsed(result, cfg.judge)
    finally:
        ctx.close()
        if cfg.report and results:
            from mmtune.evaluation.reporting.report import write_report
            from mmtune.evaluation.reporting.viewer import write_viewer

            _, plots = write_report(list(results.values()), out, title=f"Evaluation of {run_name}", sections=sections)
            before = baseline_folder(out)
            try:  # the scores are written: the page that shows them must not fail the evaluation
                write_viewer(collect_entries(cfg, out), out, title=f"Answers of {run_name}",
                             baseline=_baseline_sections(cfg, before), baseline_dir=before,
                             image_limits=ctx.image_limits)
            except Exception as err:  # noqa: BLE001 - reported, and the results stand
                log.warning("viewer.html not written: %s: %s", type(err).__name__, err)
                print(f"warning: viewer.html not written ({type(err).__name__}: {err}); the results and report are "
                      "complete", file=sys.stderr, flush=True)
            if wandb_run is not None:
                flat = {f"eval/{b}/{k}": v for b, r in results.items() for k, v in r.metrics.items()}
                import wandb

                flat.update({f"eval/plots/{p.stem}": wandb.Image(str(p)) for p in plots})
                wandb_run.log(flat)
    return results


def baseline_folder(output_dir: str | os.PathLike) -> Optional[Path]:
    """The evaluation of the model a run started from, to show beside this one: a folder
    ``<run>/eval/<name>`` (training's ``after``, or where ``mmtune train`` tells the
    evaluate command to write) has ``<run>/eval/before`` (``training.eval_before``)."""
    out = Path(output_dir)
    before = out.parent / "before"
    if out.parent.name == "eval" and out.name != "before" and before.is_dir():
        return before
    return None


def _baseline_sections(cfg: EvalConfig, folder: Optional[Path]) -> Optional[dict[str, Any]]:
    """The viewer entries of ``folder`` for ``cfg``'s benchmarks; ``None`` when it has none
    or cannot be read (the page is then written without them, and a warning says why)."""
    if folder is None:
        return None
    try:
        return collect_entries(cfg, folder) or None
    except (ValueError, OSError) as err:
        log.warning("viewer: the answers in %s are not shown beside these (%s)", folder, err)
        return None


def collect_entries(cfg: EvalConfig, output_dir: str | os.PathLike) -> dict[str, Any]:
    """``{benchmark: ViewerSection}`` for the benchmarks of ``cfg`` that left details in
    ``output_dir`` and have a viewer tab; each benchmark builds its own entries.

    lmms-eval tasks are left out: their per-sample logs are lmms-eval's own format.
    """
    from mmtune.evaluation.reporting.viewer import ViewerSection

    out = Path(output_dir)
    found = {}
    for name in cfg.benchmarks:
        if not (out / "details" / f"{name}.jsonl").is_file():
            continue
        bench = get_benchmark(name)
        entries = bench.viewer_entries(bench.settings(cfg), out,
                                       allow_absolute_image_paths=cfg.allow_absolute_image_paths)
        if entries is not None:
            found[name] = ViewerSection(entries, bench.viewer_scale)
    return found


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
    layout: Any = None,
) -> dict[str, BenchmarkResult]:
    """Evaluate an already loaded ``model`` (e.g. at the end of training) with ``cfg``; in a
    data-parallel run every rank calls it with its own copy (see :func:`run_benchmarks`)."""
    from mmtune.evaluation.generation.generator import DialogueGenerator

    was_training = getattr(model, "training", False)
    try:
        return run_benchmarks(
            cfg, output_dir=output_dir, run_name=run_name, model_label=model_label,
            make_generator=lambda: DialogueGenerator(adapter, model, cfg.generation),
            checkpoint=checkpoint, family=getattr(adapter, "family", None), wandb_run=wandb_run,
            model_config=getattr(adapter, "config", None), layout=layout,
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
    command_runner: Optional[Callable[..., Any]] = None,
    make_generator: Optional[Callable[[], Any]] = None,
    messages: Callable[[str], str] = str,
) -> dict[str, BenchmarkResult]:
    """Load ``checkpoint`` (a run dir, ``final/``, a LoRA adapter dir or ``None`` for
    ``model_config``) only if a benchmark needs generation, then run ``cfg``'s benchmarks.

    Args:
        command_runner: runs external commands (lmms-eval); ``subprocess.run`` by default.
        make_generator: replaces loading the model (tests, dry runs).
        messages: see :func:`run_benchmarks`.

    Returns:
        ``{benchmark: BenchmarkResult}``; the files are under ``output_dir``.
    """
    from mmtune.evaluation.generation.data_parallel import current_layout, lock_run_folder

    cfg = cfg or EvalConfig()
    layout = current_layout()
    # taken before the model loads and a W&B run starts: a refused run costs nothing
    with lock_run_folder(output_dir, layout, purpose="evaluation", hint=OUTPUT_HINT):
        return _evaluate_checkpoint(checkpoint, cfg, output_dir=output_dir, run_name=run_name,
                                    model_config=model_config or ModelConfig(), wandb=wandb,
                                    wandb_project=wandb_project, command_runner=command_runner,
                                    make_generator=make_generator, messages=messages, layout=layout)


def _evaluate_checkpoint(checkpoint: Optional[str], cfg: EvalConfig, *, output_dir: str, run_name: str,
                         model_config: ModelConfig, wandb: bool, wandb_project: str,
                         command_runner: Optional[Callable[..., Any]], make_generator: Optional[Callable[[], Any]],
                         messages: Callable[[str], str], layout: Any) -> dict[str, BenchmarkResult]:
    from mmtune.evaluation.generation.data_parallel import rank_device
    from mmtune.evaluation.generation.generator import DialogueGenerator
    from mmtune.evaluation.generation.loading import load_for_evaluation, resolve_checkpoint
    from mmtune.io.secrets import redact

    family = model_config.family
    lmms_pretrained, is_adapter = model_config.path, False  # baseline rows: the base model itself
    if cfg.generation.backend == "api":
        if checkpoint:
            raise ValueError(f"checkpoint={checkpoint!r} with eval.generation.backend=api: the served model "
                             f"{cfg.generation.api.model!r} answers and nothing is loaded; unset checkpoint, or set "
                             "eval.generation.backend=local to generate with the checkpoint")
        label = cfg.generation.api.model

        def load_generator():
            from mmtune.evaluation.generation.api import ApiGenerator

            generator = ApiGenerator(cfg.generation)
            print(generator.describe(), file=sys.stderr, flush=True)  # which endpoint answers; never the key
            return generator
    else:
        if checkpoint:
            resolved, peft_dir = resolve_checkpoint(checkpoint, model_config)
            family = resolved.family
            model_config = resolved if peft_dir is None else model_config
            lmms_pretrained, is_adapter = (resolved.path, False) if peft_dir is None else (checkpoint, True)
        label = checkpoint or model_config.path or f"random:{model_config.family}"

        def load_generator():
            device = rank_device(cfg.generation.device, layout)
            adapter, model, _ = load_for_evaluation(checkpoint, model_config, device=device)
            return DialogueGenerator(adapter, model, cfg.generation)

    wandb_run = None
    if wandb and layout.is_main:
        import wandb as wandb_lib

        # only the eval settings: the judge's URL and key live in the environment, not here; a
        # value interpolated from a secret variable is hidden like the key itself
        shown = redact({"name": run_name, "config": {"eval": dataclasses.asdict(cfg), "checkpoint": checkpoint}},
                       names=[cfg.judge.api_key_env])
        wandb_run = wandb_lib.init(project=wandb_project, name=shown["name"], job_type="eval", config=shown["config"])
    try:
        return run_benchmarks(cfg, output_dir=output_dir, run_name=run_name, model_label=label,
                              make_generator=make_generator or load_generator, checkpoint=checkpoint, family=family,
                              wandb_run=wandb_run, model_config=model_config, lmms_pretrained=lmms_pretrained,
                              lmms_is_adapter=is_adapter, command_runner=command_runner, layout=layout,
                              messages=messages)
    finally:
        if wandb_run is not None:
            wandb_run.finish()
