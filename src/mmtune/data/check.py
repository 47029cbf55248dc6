"""``mmtune data check CONFIG|FILE``: read and validate data, print the report.

CONFIG is a YAML file or a name under ``configs/data/`` (``synthetic``, ``add_to_pool``,
...). Extra ``key=value`` arguments override the config (``validation.mode=strict``).
FILE is a data file (JSON list or JSONL) checked as one source: its format (llava,
mmdu, xcomposer2, messages) is detected from its first records and stated in the
report (``--format`` overrides), images resolve under ``--image-root`` (default: the
file's folder). Every report ends with the image path rule each source was read with
(see :mod:`mmtune.data.paths`): relative and rooted paths joined to the image root and
kept inside it, absolute paths outside it rejected unless ``--allow-absolute-paths``.
Exit status: 0 when the data loaded (in skip mode, even with skipped records: they
are listed), 1 when strict mode found a problem or a file is missing or broken,
2 for a config error.

Example::

    mmtune data check add_to_pool --images exists
    mmtune data check configs/data/synthetic.yaml --strict --refresh
    mmtune data check data/mmdu/benchmark.json --image-root data/mmdu
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from omegaconf.errors import OmegaConfBaseException

from mmtune.data.config import FORMATS, ConfigError, DataConfig, MixtureConfig, SourceConfig, load_data_config

_DATA_SUFFIXES = (".json", ".jsonl")


def detect_format(path: str, *, sample: int = 50) -> tuple[str, str]:
    """``(format, why)`` of a data file, from its first ``sample`` records.

    Raises:
        ValueError: no record looks like any format (the message says what was seen).
    """
    from mmtune.data.readers import iter_records

    records: list[Any] = []
    for _, obj, problem in iter_records(path):
        if problem is None and isinstance(obj, dict):
            records.append(obj)
        if len(records) >= sample:
            break
    if not records:
        raise ValueError(f"{path}: no JSON object records found; pass --format {{{','.join(FORMATS)}}}")
    if sum("messages" in r for r in records) > len(records) / 2:
        return "messages", "records have a 'messages' list (OpenAI chat style)"
    convs = [r for r in records if isinstance(r.get("conversations"), list)]
    if not convs:
        keys = sorted({k for r in records for k in r})[:10]
        raise ValueError(f"{path}: records have neither 'conversations' nor 'messages' (keys seen: {keys}); "
                         f"pass --format {{{','.join(FORMATS)}}}")
    # Only strings are looked at: a value may be any JSON, nested deeper than str() follows.
    messages = [m for r in convs for m in r["conversations"] if isinstance(m, dict)]
    texts = [m["value"] for m in messages if isinstance(m.get("value"), str)]
    roles = {m["from"] for m in messages if isinstance(m.get("from"), str)}
    mmdu_marks = sum(t.count("<ImageHere>") for t in texts)
    llava_marks = sum(t.count("<image>") for t in texts)
    list_images = any(isinstance(r.get("image"), list) for r in convs)
    if mmdu_marks > llava_marks or (list_images and not llava_marks):
        if roles & {"bot", "human", "gpt"}:
            return "xcomposer2", f"'<ImageHere>' placeholders with roles {sorted(roles)} (InternLM-XComposer2 fine-tune JSON)"
        return "mmdu", f"'<ImageHere>' placeholders with roles {sorted(roles)} (MMDU schema)"
    return "llava", f"'conversations' with {'<image> placeholders' if llava_marks else 'no image placeholders'} and roles {sorted(roles)} (llava-665k schema)"


def _is_data_file(name: str) -> bool:
    return os.path.isfile(name) and name.lower().endswith(_DATA_SUFFIXES)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmtune data check", description="Validate data sources and print a report.")
    p.add_argument("config", help="data config YAML path or name under configs/data/, or a data file (.json/.jsonl)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. validation.check_images=exists")
    p.add_argument("--strict", action="store_true", help="fail at the first problem (validation.mode=strict)")
    p.add_argument("--images", choices=("verify", "decode", "exists", "none"),
                   help="image check level (validation.check_images; decode: full decode of every image)")
    p.add_argument("--refresh", action="store_true", help="re-read the files instead of using the Arrow cache")
    p.add_argument("--cache-dir", help="cache folder (data.cache_dir)")
    p.add_argument("--mixture", action="store_true", help="also print each source's samples per epoch")
    p.add_argument("--format", choices=FORMATS, help="data file only: its format (default: detected)")
    p.add_argument("--image-root", help="data file only: folder image paths are joined to (default: the file's folder)")
    p.add_argument("--allow-absolute-paths", action="store_true",
                   help="accept absolute image paths outside the image root (data.allow_absolute_image_paths=true)")
    return p


def _file_config(args: argparse.Namespace) -> tuple[DataConfig, str]:
    """A one-source config for a data file, and the line that states its format."""
    if args.format:
        fmt, why = args.format, "given with --format"
    else:
        fmt, why = detect_format(args.config)
        why = f"detected: {why}; override with --format"
    name = os.path.splitext(os.path.basename(args.config))[0] or "data"
    source = SourceConfig(name=name, format=fmt, path=args.config, image_root=args.image_root)
    return DataConfig(mixture=MixtureConfig(sources=[source])), f"format {fmt} ({why})"


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.strict:
        overrides.append("validation.mode=strict")
    if args.images:
        overrides.append(f"validation.check_images={args.images}")
    if args.cache_dir:
        overrides.append(f"cache_dir={args.cache_dir}")
    if args.allow_absolute_paths:
        overrides.append("allow_absolute_image_paths=true")
    stated = None
    from mmtune.data.validation import DataValidationError

    try:
        if _is_data_file(args.config):
            try:
                cfg, stated = _file_config(args)
            except DataValidationError as e:  # the file itself is broken, not the command line
                print(f"mmtune data check: FAILED\n{e}", file=sys.stderr)
                return 1
            import yaml
            from omegaconf import OmegaConf

            merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.structured(cfg))
            for item in overrides:
                key, _, value = item.partition("=")
                OmegaConf.update(merged, key, yaml.safe_load(value), merge=True)
            cfg = OmegaConf.to_object(merged)
            cfg.validate()
        else:
            if args.format or args.image_root:
                raise ConfigError("--format and --image-root apply to a data file; set them in the config's sources")
            cfg = load_data_config(args.config, overrides)
    except (ConfigError, OmegaConfBaseException, FileNotFoundError, ValueError) as e:
        print(f"mmtune data check: {e}", file=sys.stderr)
        return 2
    if stated:
        print(f"{args.config}: {stated}")

    from mmtune.data.mixture import build_mixture
    from mmtune.data.readers import image_rules
    from mmtune.data.validation import format_reports

    try:
        mixture = build_mixture(cfg, refresh=args.refresh)
    except (DataValidationError, FileNotFoundError, ValueError) as e:
        print(f"mmtune data check: FAILED\n{e}", file=sys.stderr)
        return 1
    print(format_reports(mixture.reports))
    print(f"\nimage paths (absolute paths outside the root {'allowed' if cfg.allow_absolute_image_paths else 'rejected'}):")
    for source in cfg.mixture.sources:
        print(f"  {source.name:<24} {image_rules(source, cfg.allow_absolute_image_paths).describe()}")
    if args.mixture:
        print(f"\nmixture (strategy {cfg.mixture.strategy}, by {cfg.mixture.by}, seed {cfg.mixture.seed}):")
        for s, c in zip(mixture.sources, mixture.counts):
            print(f"  {s.name:<24} {len(s.dialogues):>9} records  {c:>9} samples per epoch")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mmtune data ...`` (only ``check`` exists)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mmtune data check CONFIG|FILE [overrides...] [--strict] [--images LEVEL] [--refresh] "
              "[--format FMT] [--image-root DIR] [--allow-absolute-paths]")
        return 0 if argv else 2
    if argv[0] != "check":
        print(f"mmtune data: unknown subcommand {argv[0]!r} (available: check)", file=sys.stderr)
        return 2
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
