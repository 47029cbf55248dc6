"""``mmtune data check CONFIG``: read and validate every source of a data config, print the report.

CONFIG is a YAML file or a name under ``configs/data/`` (``synthetic``, ``add_to_pool``,
...). Extra ``key=value`` arguments override the config (``validation.mode=strict``).
Exit status: 0 when the data loaded (in skip mode, even with skipped records: they
are listed), 1 when strict mode found a problem or a file is missing or broken,
2 for a config error.

Example::

    mmtune data check add_to_pool --images exists
    mmtune data check configs/data/synthetic.yaml --strict --refresh
"""

from __future__ import annotations

import argparse
import sys

from omegaconf.errors import OmegaConfBaseException

from mmtune.data.config import ConfigError, load_data_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmtune data check", description="Validate data sources and print a report.")
    p.add_argument("config", help="data config YAML path or name under configs/data/")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. validation.check_images=exists")
    p.add_argument("--strict", action="store_true", help="fail at the first problem (validation.mode=strict)")
    p.add_argument("--images", choices=("verify", "exists", "none"), help="image check level (validation.check_images)")
    p.add_argument("--refresh", action="store_true", help="re-read the files instead of using the Arrow cache")
    p.add_argument("--cache-dir", help="cache folder (data.cache_dir)")
    p.add_argument("--mixture", action="store_true", help="also print each source's samples per epoch")
    return p


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.strict:
        overrides.append("validation.mode=strict")
    if args.images:
        overrides.append(f"validation.check_images={args.images}")
    if args.cache_dir:
        overrides.append(f"cache_dir={args.cache_dir}")
    try:
        cfg = load_data_config(args.config, overrides)
    except (ConfigError, OmegaConfBaseException, FileNotFoundError) as e:
        print(f"mmtune data check: {e}", file=sys.stderr)
        return 2

    from mmtune.data.mixture import build_mixture
    from mmtune.data.validation import DataValidationError, format_reports

    try:
        mixture = build_mixture(cfg, refresh=args.refresh)
    except (DataValidationError, FileNotFoundError, ValueError) as e:
        print(f"mmtune data check: FAILED\n{e}", file=sys.stderr)
        return 1
    print(format_reports(mixture.reports))
    if args.mixture:
        print(f"\nmixture (strategy {cfg.mixture.strategy}, by {cfg.mixture.by}, seed {cfg.mixture.seed}):")
        for s, c in zip(mixture.sources, mixture.counts):
            print(f"  {s.name:<24} {len(s.dialogues):>9} records  {c:>9} samples per epoch")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mmtune data ...`` (only ``check`` exists)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mmtune data check CONFIG [overrides...] [--strict] [--images LEVEL] [--refresh]")
        return 0 if argv else 2
    if argv[0] != "check":
        print(f"mmtune data: unknown subcommand {argv[0]!r} (available: check)", file=sys.stderr)
        return 2
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
