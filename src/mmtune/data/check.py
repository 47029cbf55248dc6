"""``mmtune data check CONFIG|FILE...``: read and validate data, print the report.

CONFIG is a YAML file or a name under ``configs/data/`` (``synthetic``, ``add_to_pool``,
...). Extra ``key=value`` arguments override the config (``validation.check_images=exists``).
FILE is a data file (JSON list or JSONL), checked as one source; several files are
several sources, as ``data.files`` makes them for training. A file's format (llava,
mmdu, xcomposer2, messages) is detected from its first records and stated in the report
(``--format`` overrides), images resolve under ``--image-root`` (default: the file's
folder). Every report ends with the image path rule each source was read with (see
:mod:`mmtune.data.paths`): relative and rooted paths joined to the image root and kept
inside it, absolute paths outside it rejected unless ``--allow-absolute-paths``.

Every record is read, so the report lists every problem, whatever ``validation.mode``
says; then the command decides. Exit status: 0 when every record was kept (or records
were skipped and ``--allow-skips`` accepts that), 1 when records were skipped, a file is
missing or broken, 2 for a config error. ``--strict`` (or a config with
``validation.mode: strict``) lists every problem, not only a few examples per kind, and
accepts no skipped record, so ``mmtune data check ... --strict`` can gate a pipeline.

With a model (``model=NAME`` or ``experiment=NAME``, and any ``model.``, ``collator.``,
``context.`` or ``training.`` override, composed as training composes them by
:mod:`mmtune.training.data_window`, which the ``mmtune`` command hands in), every dialogue
is also measured as training's length pass measures it (template and image tokens) and
compared with the window (:mod:`mmtune.data.window`): how many are longer than a GPU's
share of a row (what ``training.sequence_parallel.size`` buys) and which are longer than the
whole row ``collator.max_length``, with what ``collator.truncation`` does to each. Those
training would skip count as skipped records; those it would refuse fail the check.

Example::

    mmtune data check add_to_pool --images exists
    mmtune data check mmdu_45k experiment=mmdu45k_qwen2_5_vl_7b_32k model.path=/ckpt/Qwen2.5-VL-7B-Instruct
    mmtune data check configs/data/synthetic.yaml --strict --refresh
    mmtune data check data/mmdu/benchmark.json --image-root data/mmdu
    mmtune data check chat.json dialogues.jsonl --image-root imgs --allow-skips
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional

from omegaconf.errors import OmegaConfBaseException

from mmtune.data.config import ConfigError, DataConfig, MixtureConfig, load_data_config
from mmtune.data.files import DATA_SUFFIXES, sources_from_files
from mmtune.data.formats import format_names

#: overrides that belong to the training config (the model and its window), not the data config
_TRAINING_KEYS = ("model", "experiment", "collator", "context", "training")
#: examples kept per problem kind when every problem is to be listed (--strict)
EVERY_PROBLEM = 1_000_000


def _is_data_file(name: str) -> bool:
    from mmtune.data.tables import input_files, is_table_input

    return (os.path.isfile(name) and name.lower().endswith(DATA_SUFFIXES)) or (
        is_table_input(name) and bool(input_files(name)))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmtune data check", description="Read and validate a data config or data files and print the report: what was read, "
                                "kept and skipped, every problem kind with its fix and examples.",
                                epilog="Exit status: 0 every record kept (or skips accepted with --allow-skips), "
                                "1 records skipped or a file missing or broken, 2 a config error.")
    p.add_argument("config", help="data config YAML path or name under configs/data/, or a data file (.json/.jsonl)")
    p.add_argument("overrides", nargs="*", help="more data files, and config overrides such as "
                   "validation.check_images=exists; model=NAME or experiment=NAME (with model., collator., context., "
                   "training. overrides) also measures every dialogue against the training window")
    p.add_argument("--strict", action="store_true",
                   help="list every problem (not a few examples per kind) and accept no skipped record")
    p.add_argument("--allow-skips", action="store_true",
                   help="exit 0 even when records were skipped (they are still listed)")
    p.add_argument("--images", choices=("verify", "decode", "exists", "none"),
                   help="image check level (validation.check_images; decode: full decode of every image)")
    p.add_argument("--refresh", action="store_true", help="re-read the files instead of using the Arrow cache")
    p.add_argument("--cache-dir", help="cache folder (data.cache_dir)")
    p.add_argument("--mixture", action="store_true", help="also print each source's samples per epoch")
    p.add_argument("--format", choices=format_names(), help="data files only: their format (default: detected)")
    p.add_argument("--image-root", help="data files only: folder image paths are joined to (default: each file's folder)")
    p.add_argument("--allow-absolute-paths", action="store_true",
                   help="accept absolute image paths outside the image root (data.allow_absolute_image_paths=true)")
    return p


def _with_overrides(cfg: DataConfig, overrides: list[str]) -> DataConfig:
    """``cfg`` with ``key=value`` overrides applied, checked against the schema."""
    import yaml
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.structured(cfg))
    for item in overrides:
        key, _, value = item.partition("=")
        OmegaConf.update(merged, key, yaml.safe_load(value), merge=True)
    return OmegaConf.to_object(merged)


def _files_config(files: list[str], args: argparse.Namespace, overrides: list[str]) -> tuple[DataConfig, list[str]]:
    """A config with one source per data file and the overrides, and the line that states each one's format."""
    limit = _with_overrides(DataConfig(), overrides).validation.max_record_bytes  # detection reads no more
    sources, reasons = sources_from_files(files, args.image_root, key="FILE", fmt=args.format, max_record_bytes=limit)
    stated = [f"{s.path}: format {s.format} ({why}{'' if args.format else '; override with --format'})"
              for s, why in zip(sources, reasons)]
    return _with_overrides(DataConfig(mixture=MixtureConfig(sources=sources)), overrides), stated


def _verdict(reports: list[Any], *, strict: bool, allow_skips: bool, window: Any = None) -> tuple[int, str]:
    """Exit status and the closing line, from what was skipped (when reading, and for the window)."""
    read = sum(r.records_read for r in reports)
    skipped = sum(r.records_skipped for r in reports)
    reasons: dict[str, int] = {}
    for r in reports:
        for code, n in r.skipped.items():
            reasons[code] = reasons.get(code, 0) + n
    firsts = [f"  first in {r.source}: {r.first_problem}" for r in reports if r.first_problem]
    if window is not None and window.skipped:
        too_long = [d for d in window.over_row if d.kept == 0 or window.truncation == "error"]
        code = "longer_than_window"
        reasons[code] = len(too_long)
        skipped += len(too_long)
        firsts.append(f"  first longer than the {window.max_length}-token row: {too_long[0].describe()}")
        if window.truncation == "error":
            return 1, (f"data check: FAILED: {len(too_long)} dialogue(s) longer than collator.max_length="
                       f"{window.max_length}, which training refuses (collator.truncation=error); shorten them, raise "
                       "collator.max_length (with training.sequence_parallel.size to keep a GPU's share), or set "
                       "collator.truncation to drop_trailing_turns or skip_sample\n" + "\n".join(firsts))
    if not skipped:
        return 0, f"data check: OK, all {read} record(s) of {len(reports)} source(s) kept"
    why = ", ".join(f"{code} {n}" for code, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
    if allow_skips:
        return 0, f"data check: OK with --allow-skips: {skipped} of {read} record(s) skipped ({why}), listed above"
    fix = "fix them" if strict else "fix them, or pass --allow-skips to train without them"
    return 1, f"data check: FAILED: {skipped} of {read} record(s) skipped ({why}); {fix}\n" + "\n".join(firsts)


def _split_arguments(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """``(data files or config, data config overrides, training overrides)`` of the command line,
    the options turned into data config overrides."""
    files = [a for a in [args.config, *args.overrides] if "=" not in a]
    overrides = [a for a in args.overrides if "=" in a]
    training = [a for a in overrides if a.lstrip("+").split("=", 1)[0].split(".", 1)[0] in _TRAINING_KEYS]
    overrides = [a for a in overrides if a not in training]
    if args.images:
        overrides.append(f"validation.check_images={args.images}")
    if args.cache_dir:
        overrides.append(f"cache_dir={args.cache_dir}")
    if args.allow_absolute_paths:
        overrides.append("allow_absolute_image_paths=true")
    return files, overrides, training


def _print_report(cfg: DataConfig, mixture: Any, *, with_mixture: bool) -> None:
    """The sources' reports, their image path rules and (``--mixture``) samples per epoch."""
    from mmtune.data.readers import image_rules
    from mmtune.data.validation import format_reports

    print(format_reports(mixture.reports))
    print(f"\nimage paths (absolute paths outside the root {'allowed' if cfg.allow_absolute_image_paths else 'rejected'}):")
    for source in cfg.mixture.sources:
        print(f"  {source.name:<24} {image_rules(source, cfg.allow_absolute_image_paths).describe()}")
    if with_mixture:
        print(f"\nmixture (strategy {cfg.mixture.strategy}, by {cfg.mixture.by}, seed {cfg.mixture.seed}):")
        for s, c in zip(mixture.sources, mixture.counts):
            print(f"  {s.name:<24} {len(s.dialogues):>9} records  {c:>9} samples per epoch")


def run(argv: list[str], *, training_window: Optional[Callable[[list[str]], Any]] = None) -> int:
    """``mmtune data check`` with ``argv``.

    Args:
        training_window: ``training_window(overrides)`` -> the window of the run those
            ``model``/``experiment``/``collator``/``context``/``training`` overrides compose to
            (``None`` without a model): an object with ``image_limits`` and ``measure(data_config,
            mixture)`` returning a :class:`~mmtune.data.window.WindowReport`. Handed in by the
            ``mmtune`` command (:func:`mmtune.training.data_window.training_window`): the data
            layer does not compose training configs or build models itself.
    """
    args = _parser().parse_args(argv)
    files, overrides, training = _split_arguments(args)
    stated: list[str] = []
    from mmtune.data.validation import DataValidationError

    try:
        if args.strict and args.allow_skips:
            raise ConfigError("--strict accepts no skipped record and --allow-skips accepts them: pass one of the two")
        if _is_data_file(args.config):
            try:
                cfg, stated = _files_config(files, args, overrides)
            except DataValidationError as e:  # the file itself is broken, not the command line
                print(f"mmtune data check: FAILED\n{e}", file=sys.stderr)
                return 1
            cfg.validate()
        else:
            if len(files) > 1:
                raise ConfigError(f"{files[1]!r} is neither key=value nor a .json/.jsonl file"
                                  + ("" if os.path.exists(files[1]) else " that exists"))
            if args.format or args.image_root:
                raise ConfigError("--format and --image-root apply to data files; set them in the config's sources")
            cfg = load_data_config(args.config, overrides)
        window_of = None
        if training:
            if training_window is None:
                raise ConfigError(f"{' '.join(training)}: the window is measured by the mmtune command: "
                                  "run `mmtune data check ...`")
            window_of = training_window(training)
            if window_of is None:
                raise ConfigError(f"{' '.join(training)}: the window is measured with a model; add model=NAME or "
                                  "experiment=NAME")
    except (ConfigError, OmegaConfBaseException, FileNotFoundError, ValueError) as e:
        print(f"mmtune data check: {e}", file=sys.stderr)
        return 2
    for line in stated:
        print(line)
    strict = args.strict or cfg.validation.mode == "strict"
    # Every record is read whatever the mode, so the report can list every problem;
    # strictness decides the exit status below.
    cfg.validation.mode = "skip"
    if strict:
        cfg.validation.max_examples = EVERY_PROBLEM

    from mmtune.data.mixture import build_mixture

    try:
        mixture = build_mixture(cfg, refresh=args.refresh,
                                image_limits=window_of.image_limits if window_of is not None else None)
    except (DataValidationError, FileNotFoundError, ValueError) as e:
        print(f"mmtune data check: FAILED\n{e}", file=sys.stderr)
        return 1
    _print_report(cfg, mixture, with_mixture=args.mixture)
    window = None
    if window_of is not None:
        try:
            window = window_of.measure(cfg, mixture)
        except (OSError, ValueError) as e:  # the model's files, an image it cannot count (strict mode)
            print(f"mmtune data check: FAILED measuring the window with the model\n{e}", file=sys.stderr)
            return 1
        print("\n" + window.render(EVERY_PROBLEM if strict else cfg.validation.max_examples))
    code, verdict = _verdict(mixture.reports, strict=strict, allow_skips=args.allow_skips, window=window)
    print("\n" + verdict, file=sys.stderr if code else sys.stdout)
    return code


SUBCOMMANDS = {
    "check": "read and validate data configs or data files, print what would be skipped and why",
    "build": "make MMDU-style multi-image dialogues from your own corpus with a teacher model",
}


def _usage() -> str:
    lines = ["usage: mmtune data <subcommand> [args...]", "", "subcommands:"]
    lines += [f"  {name:<8} {text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "`mmtune data check -h` and `mmtune data build -h` list each one's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, training_window: Optional[Callable[[list[str]], Any]] = None) -> int:
    """Entry point of ``mmtune data ...``: ``check`` here (``training_window``: see :func:`run`), ``build`` in
    :mod:`mmtune.data.build.cli`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "build":
        from mmtune.data.build.cli import main as build_main

        return int(build_main(argv[1:]) or 0)
    if argv[0] != "check":
        print(f"mmtune data: unknown subcommand {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return run(argv[1:], training_window=training_window)


if __name__ == "__main__":
    sys.exit(main())
