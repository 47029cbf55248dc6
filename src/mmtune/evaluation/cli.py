"""``mmtune evaluate``: score predictions made elsewhere, evaluate a checkpoint, lmms-eval hand-off.

    mmtune evaluate score mmvet --data mm-vet.json --predictions results.json --out eval/ --runs 5
    mmtune evaluate score mmdu --data benchmark.json --predictions answers.json --out eval/
    mmtune evaluate score mdi --predictions mdi_with_responses.json --out eval/
    mmtune evaluate checkpoint outputs/demo/final synthetic --data test.json --image-root images/ --out eval/
    mmtune evaluate checkpoint runs/x/final mmdu --data benchmark.json --image-root mmdu/ --out eval/ --processes 8
    mmtune evaluate lmms-command outputs/run/final --tasks mmmu_val,ai2d --out eval/lmms
    mmtune evaluate lmms-parse eval/lmms/results.json --out eval/
    mmtune evaluate report eval/
    mmtune evaluate experiment=table3_llava15_7b_mmdu45k_eval      # a Hydra config, as recipes/evaluate.py

Each benchmark's flags are its ``eval.<name>`` settings (``mmtune evaluate score mmvet -h``
lists them with their docs), plus the judge's; ``checkpoint`` decodes as the benchmark's
``configs/eval/<name>.yaml`` does (its ``generation`` section: 32 new tokens for synthetic,
512 for MDI, 1024 for MM-Vet, 2048 for MMDU) unless a flag says otherwise.

Judge settings come from the environment (MMTUNE_JUDGE_BASE_URL, MMTUNE_JUDGE_API_KEY,
MMTUNE_JUDGE_MODEL; OPENAI_BASE_URL / OPENAI_API_KEY when those are unset) or
``--judge-model``. A judge call that still fails after retries makes the command exit
non-zero (``--max-failed-share`` to allow some). Arguments of the form ``key=value`` (and
``experiment=<name>``) run the Hydra config of recipes/evaluate.py instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import typing
from pathlib import Path
from typing import Any, Optional

from mmtune.evaluation.config import EvalConfig

__all__ = ["REFUSALS", "build_parser", "config_from_args", "setting_flags", "checkpoint_command", "flag_names", "with_flags",
           "run_config", "main"]


@dataclasses.dataclass(frozen=True)
class _Flag:
    """A command-line flag of one ``eval`` setting; its type and help come from the schema."""

    key: str
    """Dotted key in :class:`EvalConfig` (``judge.model``, ``mmvet.runs``)."""
    const: Any = None
    """For a bool setting: the value the flag sets (``--no-kv-reuse`` sets False)."""


#: flags of the settings outside the benchmark's own section, on every benchmark's command
_COMMON = {
    "--judge-model": _Flag("judge.model"),
    "--send-images": _Flag("judge.send_images", True),
    "--concurrency": _Flag("judge.concurrency"),
    "--judge-timeout": _Flag("judge.timeout_s"),
    "--no-judge-check": _Flag("judge.check_first", False),
    "--max-failed-share": _Flag("judge.max_failed_share"),
    "--max-unparsed-share": _Flag("judge.max_unparsed_share"),
    "--allow-absolute-paths": _Flag("allow_absolute_image_paths", True),
    "--quiet": _Flag("progress", False),
}
#: decoding flags of ``checkpoint``; their defaults are the benchmark's (its configs/eval/<name>.yaml)
_GENERATION = {
    "--max-new-tokens": _Flag("generation.max_new_tokens"),
    "--context-length": _Flag("generation.context_length"),
    "--no-kv-reuse": _Flag("generation.kv_reuse", False),
    "--batch-size": _Flag("generation.batch_size"),
    "--device": _Flag("generation.device"),
}
#: a benchmark setting's flag is ``--<field-name>`` unless it has other names here
_SETTING_FLAGS = {"data_path": ("--data", "--data-path")}
_DEST = "eval:"  # argparse dest prefix of the flags that set an eval key


_TAKEN = set(_COMMON) | set(_GENERATION) | {"--out", "--run", "--model", "--family", "--trust-remote-code"}


def setting_flags(benchmark: str, name: str) -> tuple[str, ...]:
    """The flags of setting ``eval.<benchmark>.<name>``: ``--<name>`` (``--data`` for
    ``data_path``), or ``--<benchmark>-<name>`` where a common flag has that name."""
    names = _SETTING_FLAGS.get(name, (f"--{name.replace('_', '-')}",))
    return tuple(n if n not in _TAKEN else f"--{benchmark}-{n[2:]}" for n in names)


def checkpoint_command(checkpoint: str, benchmark: str, settings: dict[str, Any], out: str,
                       run: Optional[str] = None) -> str:
    """The ``mmtune evaluate checkpoint`` command that evaluates ``checkpoint`` on
    ``benchmark`` with these ``eval.<benchmark>`` settings (``None`` values left out),
    labelled ``run`` in its results, written with this command's own flags, ready to
    paste into a shell."""
    parts = ["mmtune", "evaluate", "checkpoint", str(checkpoint), benchmark]
    for name, value in settings.items():
        if value is not None and not isinstance(value, (list, dict)):
            parts += [setting_flags(benchmark, name)[0], str(value)]
    return shlex.join(parts + ["--out", str(out)] + (["--run", run] if run else []))


def _schema_field(cfg: EvalConfig, key: str) -> tuple[Any, str]:
    """(the dataclass instance holding ``key``, the field name)."""
    *path, name = key.split(".")
    owner = cfg
    for part in path:
        owner = getattr(owner, part)
    if name not in {f.name for f in dataclasses.fields(owner)}:
        raise ValueError(f"{key} is not an eval setting ({type(owner).__name__} has no field {name!r})")
    return owner, name


def _add_flag(parser: argparse.ArgumentParser, names: tuple[str, ...], flag: _Flag, cfg: EvalConfig,
              required: bool = False) -> bool:
    """Add one flag typed and documented by its schema field; False when the field is not a
    scalar (lists and dicts are set in a YAML config instead)."""
    from mmtune.argparsing import plain_text
    from mmtune.schema_keys import field_docs

    owner, name = _schema_field(cfg, flag.key)
    kind = typing.get_type_hints(type(owner))[name]
    if typing.get_origin(kind) is typing.Union:
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
    doc = plain_text(" ".join(field_docs(type(owner)).get(name, "").split())).replace("%", "%%")
    default = getattr(owner, name)
    kwargs: dict[str, Any] = {"dest": _DEST + flag.key, "default": argparse.SUPPRESS, "required": required}
    if kind is bool:
        const = True if flag.const is None else flag.const
        kwargs.update(action="store_const", const=const, help=f"set {flag.key}={str(const).lower()}. {doc}")
    elif kind in (int, float, str):
        shown = "" if required else f"; default: {default}"
        kwargs.update(type=kind, metavar=name.upper(), help=f"{doc} ({flag.key}{shown})")
    else:
        return False
    parser.add_argument(*names, **kwargs)
    return True


def _benchmark_parser(parent: Any, bench: Any, *, generate: bool) -> None:
    """The parser of ``score <name>`` / ``checkpoint ... <name>``: the benchmark's own settings
    (every scalar field of its ``settings_class``), the judge and path flags, and for
    ``checkpoint`` the decoding flags with the benchmark's defaults."""
    cfg = EvalConfig(benchmarks=[bench.name])
    defaults = bench.cli_defaults() if generate else {}
    for key, value in defaults.items():
        try:
            owner, name = _schema_field(cfg, key)
        except ValueError as err:
            raise ValueError(f"{bench.config_file()}: {err}; fix the file's `generation` section") from None
        setattr(owner, name, value)
    doc = (type(bench).__doc__ or "").strip().splitlines()[0] if type(bench).__doc__ else bench.name
    parser = parent.add_parser(bench.name, help=doc, description=doc)
    parser.add_argument("--out", required=True, help="output directory for results, details and the report")
    parser.add_argument("--run", default="eval", help="run label written into the results")
    if not generate:
        parser.add_argument("--model", default="external", help="model label written into the results")
    for field in dataclasses.fields(bench.settings_class):
        if generate and field.name == "predictions":
            continue  # `checkpoint` generates the answers
        names = setting_flags(bench.name, field.name)
        _add_flag(parser, names, _Flag(f"{bench.name}.{field.name}"), cfg,
                  required=not generate and field.name == "predictions")
    for flags in (_COMMON, _GENERATION) if generate else (_COMMON,):
        for name, flag in flags.items():
            _add_flag(parser, (name,), flag, cfg)
    if generate:
        parser.add_argument("--family", default="llava", help="model family when the directory has no mmtune_run.json")
        parser.add_argument("--trust-remote-code", action="store_true",
                            help="allow Python code shipped with the checkpoint to run (off: such checkpoints are refused)")
        parser.add_argument("--processes", type=int, default=1, metavar="N",
                            help="data-parallel processes, one per GPU: the command runs itself N times through "
                            "torchrun, each process answers its share of the dialogues, the first one scores")
    parser.set_defaults(cli_defaults=defaults)


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The :class:`EvalConfig` of a parsed ``score`` / ``checkpoint`` command: the benchmark's
    decoding defaults (``checkpoint``), then every flag given, on a fresh config."""
    cfg = EvalConfig(benchmarks=[args.benchmark])
    values = dict(args.cli_defaults)
    values.update({k[len(_DEST):]: v for k, v in vars(args).items() if k.startswith(_DEST)})
    for key, value in values.items():
        owner, name = _schema_field(cfg, key)
        setattr(owner, name, value)
    return cfg


def flag_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """``{eval key: flag}`` of the command ``args`` was parsed for (``judge.concurrency`` ->
    ``--concurrency``), so messages written with config keys can name this command's flags."""
    names: dict[str, str] = {}
    node: Any = parser
    for step in (getattr(args, "command", None), getattr(args, "benchmark", None)):
        sub = next((a for a in node._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or step not in sub.choices:
            break
        node = sub.choices[step]
    for action in node._actions:
        if action.dest.startswith(_DEST) and action.option_strings:
            names[action.dest[len(_DEST):]] = action.option_strings[0]
    return names


def with_flags(text: str, names: dict[str, str]) -> str:
    """``text`` with each config key of ``names`` (``eval.judge.concurrency`` or
    ``judge.concurrency``) replaced by its flag; other keys are left as they are."""
    import re

    for key in sorted(names, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.$-])(?:eval\.)?{re.escape(key)}(?![\w])", names[key], text)
    return text


def _print(results, output_dir: str) -> None:
    """Each benchmark's headline metrics, then where its result file, the report and the viewer are."""
    from mmtune.evaluation.results import result_filename

    if not results:  # another rank of a data-parallel run: rank 0 scores and reports
        return
    out = Path(output_dir)
    files = []
    for name, result in results.items():
        headline = {k: round(v, 2) for k, v in result.metrics.items() if "/" not in k}
        print(f"{name}: {headline}  counts={result.counts}")
        files.append((f"result {name}", out / result_filename(result)))
    for label, path in files + [("report", out / "report.html"), ("viewer", out / "viewer.html")]:
        if path.is_file():
            print(f"  {label + ':':<15} {path}")


def build_parser() -> argparse.ArgumentParser:
    """The ``mmtune evaluate`` parser, one ``score`` / ``checkpoint`` command per registered benchmark."""
    from mmtune.evaluation.benchmarks.registry import get_benchmark, registered_names

    from mmtune.argparsing import ArgumentParser, plain_text

    parser = ArgumentParser(prog="mmtune evaluate", description=plain_text(__doc__),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    # every registered benchmark that mmtune generates answers for; lmms-eval has its own commands
    benchmarks = [bench for bench in map(get_benchmark, registered_names()) if bench.generates]

    score = sub.add_parser("score", help="score an existing predictions file (no model needed)")
    score_benchmarks = score.add_subparsers(dest="benchmark", required=True, metavar="benchmark")
    for bench in benchmarks:
        _benchmark_parser(score_benchmarks, bench, generate=False)

    ckpt = sub.add_parser("checkpoint", help="generate with a saved checkpoint and score")
    ckpt.add_argument("checkpoint", help="run dir, final/, LoRA adapter dir")
    ckpt_benchmarks = ckpt.add_subparsers(dest="benchmark", required=True, metavar="benchmark")
    for bench in benchmarks:
        _benchmark_parser(ckpt_benchmarks, bench, generate=True)

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
    return parser


def run_config(config: Any) -> dict[str, Any]:
    """Evaluate an :class:`~mmtune.evaluation.config.EvaluateConfig` (what ``recipes/evaluate.py``
    and ``mmtune evaluate key=value ...`` run); prints the headline metrics and the folder."""
    from mmtune.evaluation.config import default_output_dir
    from mmtune.evaluation.generation.data_parallel import close_layout, current_layout
    from mmtune.evaluation.runner import evaluate_checkpoint

    output_dir = config.output_dir or default_output_dir(config.run_name, config.checkpoint, config.model,
                                                         config.eval.generation)
    results = evaluate_checkpoint(config.checkpoint, config.eval, output_dir=output_dir, run_name=config.run_name,
                                  model_config=config.model, wandb=config.wandb, wandb_project=config.wandb_project)
    close_layout(current_layout())
    if not results:  # another rank of a data-parallel run: rank 0 scores and reports
        return results
    for name, result in results.items():
        headline = {k: round(v, 2) for k, v in result.metrics.items() if "/" not in k}
        print(f"{name}: {headline}")
    print(f"results and report in {output_dir}")
    return results


#: what an evaluation stops with as one message (exit status 2): the user's config, files or checkpoint
REFUSALS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, RuntimeError)


def _run_overrides(overrides: list[str]) -> int:
    """``mmtune evaluate experiment=... key=value``: the evaluate recipe's config, composed and run."""
    from mmtune.compose import OverrideError, compose_checked
    from mmtune.evaluation.config import to_evaluate_config

    try:
        config = to_evaluate_config(compose_checked(overrides, "evaluate", command="mmtune evaluate"))
    except (OverrideError, ValueError) as err:
        print(f"mmtune evaluate: {err}", file=sys.stderr)
        return 2
    try:
        run_config(config)
    except REFUSALS as err:
        print(f"mmtune evaluate: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and ("=" in argv[0] or argv[0].startswith(("+", "~"))):  # Hydra overrides, as for recipes/evaluate.py
        return _run_overrides(argv)
    try:
        parser = build_parser()
    except ValueError as err:  # a benchmark's own config names a setting that does not exist
        print(f"mmtune evaluate: {err}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    names = flag_names(parser, args)

    def say(text: str) -> str:  # the hints of config keys, written as this command's flags
        return with_flags(text, names)

    try:
        if args.command == "score":
            from mmtune.evaluation.runner import run_benchmarks

            results = run_benchmarks(config_from_args(args), output_dir=args.out, run_name=args.run,
                                     model_label=args.model, messages=say)
            _print(results, args.out)
        elif args.command == "checkpoint":
            if args.processes < 1:
                raise ValueError(f"--processes {args.processes}: must be >= 1")
            if args.processes > 1 and "WORLD_SIZE" not in os.environ:
                return _launch(args.processes, sys.argv[1:] if argv is None else list(argv))
            from mmtune.evaluation.generation.data_parallel import close_layout, current_layout
            from mmtune.evaluation.runner import evaluate_checkpoint
            from mmtune.models.config import ModelConfig

            _print(evaluate_checkpoint(args.checkpoint, config_from_args(args), output_dir=args.out, run_name=args.run,
                                       model_config=ModelConfig(family=args.family, trust_remote_code=args.trust_remote_code),
                                       messages=say), args.out)
            close_layout(current_layout())
        elif args.command == "lmms-command":
            from mmtune.evaluation.benchmarks.lmms_eval import LmmsEvalConfig, build_command

            cfg = LmmsEvalConfig(tasks=args.tasks.split(","), model_type=args.model_type)
            print(shlex.join(build_command(args.checkpoint, cfg, family=args.family, output_path=args.out)))
        elif args.command == "lmms-parse":
            from mmtune.evaluation.benchmarks.lmms_eval import parse_results
            from mmtune.evaluation.results import write_result
            from mmtune.evaluation.runner import OUTPUT_HINT
            from mmtune.io.locks import lock_directory

            with lock_directory(args.out, purpose="evaluation", hint=OUTPUT_HINT):
                for result in parse_results(args.results, run=args.run, model=args.model):
                    print(write_result(result, args.out))
        elif args.command == "report":
            from mmtune.evaluation.benchmarks.registry import benchmarks_for
            from mmtune.evaluation.reporting.report import write_report
            from mmtune.evaluation.results import read_result
            from mmtune.io.locks import lock_directory

            # the report is rewritten in place: not while an evaluation writes into the folder
            with lock_directory(args.directory, purpose="report", hint="run the report once that evaluation is done"):
                results = []
                for path in sorted(Path(args.directory).glob("*.json")):
                    try:
                        results.append(read_result(path))
                    except ValueError:
                        continue  # other JSON files in the directory (MM-Vet's results JSON)
                sections = benchmarks_for(r.benchmark for r in results)
                print(write_report(results, args.directory, sections=sections)[0])
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"mmtune evaluate: {say(str(err))}", file=sys.stderr)
        return 2
    return 0


def _launch(processes: int, argv: list[str]) -> int:
    """Run ``mmtune evaluate <argv>`` in ``processes`` processes through torchrun's own launcher
    (on this machine, a free rendezvous port); its exit status is theirs (non-zero when a rank
    failed).

    torchrun's parser sees only its own options: ``argv`` is handed to the processes after
    parsing, because argparse scans every word of a command line for option prefixes, even
    after the script name, and would read mmtune's ``--run`` as an ambiguous prefix of
    torchrun's ``--run-path`` (exit 2 before any process starts).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    launcher = ["--standalone", "--nproc_per_node", str(processes), "-m", "mmtune.cli"]
    args = get_args_parser().parse_args(launcher)
    args.training_script_args = ["evaluate", *argv]
    shown = shlex.join(["torchrun", *launcher, *args.training_script_args])
    print(f"mmtune evaluate: launching {processes} processes: {shown}", file=sys.stderr, flush=True)
    try:
        run(args)
    except ChildFailedError as err:
        codes = [failure.exitcode for failure in err.failures.values()]
        print(f"mmtune evaluate: {len(codes)} of {processes} processes failed (exit status {codes}); "
              "their errors are above", file=sys.stderr, flush=True)
        return next((code for code in codes if code > 0), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
