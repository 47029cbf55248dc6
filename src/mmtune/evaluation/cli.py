"""``mmtune evaluate``: score predictions made elsewhere, evaluate a checkpoint, lmms-eval hand-off.

    mmtune evaluate score mmvet --data mm-vet.json --predictions results.json --out eval/ --runs 5
    mmtune evaluate score mmdu --data benchmark.json --predictions answers.json --out eval/
    mmtune evaluate score mdi --predictions mdi_with_responses.json --out eval/
    mmtune evaluate checkpoint outputs/demo/final synthetic --data test.json --image-root images/ --out eval/
    mmtune evaluate lmms-command outputs/run/final --tasks mmmu_val,ai2d --out eval/lmms
    mmtune evaluate lmms-parse eval/lmms/results.json --out eval/
    mmtune evaluate report eval/

Judge settings come from the environment (MMTUNE_JUDGE_BASE_URL, MMTUNE_JUDGE_API_KEY,
MMTUNE_JUDGE_MODEL; OPENAI_BASE_URL / OPENAI_API_KEY when those are unset) or
``--judge-model``. A judge call that still fails after retries makes the command exit
non-zero (``--max-failed-share`` to allow some). For a full Hydra config use recipes/evaluate.py.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Optional

from mmtune.evaluation.config import EvalConfig

__all__ = ["main"]


def _eval_config(args: argparse.Namespace, benchmark: str) -> EvalConfig:
    cfg = EvalConfig(benchmarks=[benchmark], progress=not args.quiet)
    sub = getattr(cfg, benchmark)
    sub.data_path = args.data
    sub.image_root = args.image_root
    if getattr(args, "predictions", None):
        sub.predictions = args.predictions
    if args.limit is not None:
        sub.limit = args.limit
    if getattr(args, "prompt_file", None) and hasattr(sub, "prompt_file"):
        sub.prompt_file = args.prompt_file
    if benchmark == "mmvet" and args.runs is not None:
        cfg.mmvet.runs = args.runs
    if benchmark == "mdi" and args.alpha is not None:
        cfg.mdi.alpha = args.alpha
    if args.judge_model:
        cfg.judge.model = args.judge_model
    cfg.judge.send_images = args.send_images
    cfg.allow_absolute_image_paths = args.allow_absolute_paths
    if args.concurrency is not None:
        cfg.judge.concurrency = args.concurrency
    if args.max_failed_share is not None:
        cfg.judge.max_failed_share = args.max_failed_share
    if benchmark == "mmvet" and args.bard_subset:
        cfg.mmvet.bard_subset = args.bard_subset
    return cfg


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", help="benchmark file (questions / references)")
    parser.add_argument("--image-root", help="directory image paths are relative to")
    parser.add_argument("--out", required=True, help="output directory for results, details and the report")
    parser.add_argument("--run", default="eval", help="run label written into the results")
    parser.add_argument("--limit", type=int, help="only the first N dialogues / items")
    parser.add_argument("--judge-model", help="judge model name (else $MMTUNE_JUDGE_MODEL)")
    parser.add_argument("--send-images", action="store_true", help="attach images to judge calls")
    parser.add_argument("--allow-absolute-paths", action="store_true",
                        help="accept absolute image paths outside --image-root (default: rejected as path_outside_root)")
    parser.add_argument("--concurrency", type=int, help="judge calls in flight")
    parser.add_argument("--runs", type=int, help="MM-Vet judge runs (default 5)")
    parser.add_argument("--alpha", type=float, help="MDI Score_final weight of level 1 (default 0.5)")
    parser.add_argument("--prompt-file", help="judge prompt: a template (MMDU / MM-Vet) or MM-Vet's official prompt "
                                              "saved to a file (reports record its name and hash)")
    parser.add_argument("--bard-subset", help="MM-Vet: evaluate only the items of this bard_set.json")
    parser.add_argument("--max-failed-share", type=float,
                        help="share of judge calls allowed to fail before exiting non-zero (default 0: any failure)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _print(results) -> None:
    for name, result in results.items():
        headline = {k: round(v, 2) for k, v in result.metrics.items() if "/" not in k}
        print(f"{name}: {headline}  counts={result.counts}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mmtune evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    score = sub.add_parser("score", help="score an existing predictions file (no model needed)")
    score.add_argument("benchmark", choices=["synthetic", "mmdu", "mmvet", "mdi"])
    score.add_argument("--predictions", required=True, help="MMDU-schema answers / generation JSONL, MM-Vet results JSON, MDI items with 'response'")
    score.add_argument("--model", default="external", help="model label written into the results")
    _common(score)

    ckpt = sub.add_parser("checkpoint", help="generate with a saved checkpoint and score")
    ckpt.add_argument("checkpoint", help="run dir, final/, LoRA adapter dir")
    ckpt.add_argument("benchmark", choices=["synthetic", "mmdu", "mmvet", "mdi"])
    ckpt.add_argument("--max-new-tokens", type=int, help="default 2048")
    ckpt.add_argument("--context-length", type=int, help="evaluation context window (tokens)")
    ckpt.add_argument("--no-kv-reuse", action="store_true", help="re-encode the history every turn")
    ckpt.add_argument("--batch-size", type=int, default=None, help="dialogues decoded together (default: by model size)")
    ckpt.add_argument("--device", default="auto")
    ckpt.add_argument("--family", default="llava", help="model family when the directory has no mmtune_run.json")
    ckpt.add_argument("--trust-remote-code", action="store_true",
                      help="allow Python code shipped with the checkpoint to run (off: such checkpoints are refused)")
    _common(ckpt)

    cmd = sub.add_parser("lmms-command", help="print the lmms-eval command for an exported checkpoint")
    cmd.add_argument("checkpoint")
    cmd.add_argument("--family", default="llava")
    cmd.add_argument("--model-type", help="lmms-eval --model (default from the family)")
    cmd.add_argument("--tasks", required=True, help="comma-separated lmms-eval tasks")
    cmd.add_argument("--out", required=True, help="lmms-eval --output_path")

    parse = sub.add_parser("lmms-parse", help="convert an lmms-eval results JSON into mmtune results")
    parse.add_argument("results")
    parse.add_argument("--out", required=True)
    parse.add_argument("--run", default="eval")
    parse.add_argument("--model", default="external")

    report = sub.add_parser("report", help="rebuild report.md and plots from the result JSONs in a directory")
    report.add_argument("directory")

    args = parser.parse_args(argv)
    try:
        if args.command == "score":
            from mmtune.evaluation.runner import run_benchmarks

            results = run_benchmarks(_eval_config(args, args.benchmark), output_dir=args.out, run_name=args.run, model_label=args.model)
            _print(results)
        elif args.command == "checkpoint":
            from mmtune.evaluation.runner import evaluate_checkpoint

            cfg = _eval_config(args, args.benchmark)
            if args.max_new_tokens:
                cfg.generation.max_new_tokens = args.max_new_tokens
            cfg.generation.context_length = args.context_length
            cfg.generation.kv_reuse = not args.no_kv_reuse
            cfg.generation.batch_size = args.batch_size
            cfg.generation.device = args.device
            from mmtune.models.config import ModelConfig

            _print(evaluate_checkpoint(args.checkpoint, cfg, output_dir=args.out, run_name=args.run,
                                       model_config=ModelConfig(family=args.family, trust_remote_code=args.trust_remote_code)))
        elif args.command == "lmms-command":
            from mmtune.evaluation.benchmarks.lmms_eval import LmmsEvalConfig
            from mmtune.evaluation.benchmarks.lmms_eval import build_command

            cfg = LmmsEvalConfig(tasks=args.tasks.split(","), model_type=args.model_type)
            print(shlex.join(build_command(args.checkpoint, cfg, family=args.family, output_path=args.out)))
        elif args.command == "lmms-parse":
            from mmtune.evaluation.benchmarks.lmms_eval import parse_results
            from mmtune.evaluation.results import write_result

            for result in parse_results(args.results, run=args.run, model=args.model):
                print(write_result(result, args.out))
        elif args.command == "report":
            from mmtune.evaluation.benchmarks.registry import benchmarks_for
            from mmtune.evaluation.reporting.report import write_report
            from mmtune.evaluation.results import read_result

            results = []
            for path in sorted(Path(args.directory).glob("*.json")):
                try:
                    results.append(read_result(path))
                except ValueError:
                    continue  # other JSON files in the directory (MM-Vet's results JSON)
            sections = benchmarks_for(r.benchmark for r in results)
            print(write_report(results, args.directory, sections=sections)[0])
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"mmtune evaluate: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
