"""``mmtune data build CONFIG``: corpus -> clusters -> image sets -> teacher dialogues -> MMDU JSON.

CONFIG is a YAML file or a name under ``configs/build/``; ``key=value`` arguments
override it (``output.dir=out teacher.concurrency=32``).

Examples::

    mmtune data build demo output.dir=/tmp/built          # plan, generate, merge
    mmtune data build my_corpus.yaml --stage plan         # once, before a slurm array
    mmtune data build my_corpus.yaml --shard $SLURM_ARRAY_TASK_ID/8
    mmtune data build my_corpus.yaml --stage merge --shards 8

Exit status: 0 done, 1 a build error (message says what and how to fix), 2 a config error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from omegaconf.errors import OmegaConfBaseException

from mmtune.data.config import ConfigError

STAGES = ("all", "plan", "generate", "merge")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmtune data build", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="build config YAML or name under configs/build/")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.add_argument("--shard", default="0/1", help="i/n: generate only shard i of n (0-based); default 0/1")
    p.add_argument("--stage", choices=STAGES, default="all",
                   help="all: plan + generate (+ merge when n=1); or one stage alone")
    p.add_argument("--shards", type=int, default=None, help="--stage merge: number of shards to merge (default: n of --shard)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from mmtune.data.build.config import load_build_config

    try:
        cfg = load_build_config(args.config, args.overrides)
    except (ConfigError, OmegaConfBaseException, FileNotFoundError) as e:
        print(f"mmtune data build: {e}", file=sys.stderr)
        return 2

    from mmtune.data.build.pipeline import BuildError, generate_shard, load_or_make_plan, parse_shard
    from mmtune.data.build.writer import merge, render_stats, verify_output
    from mmtune.data.validation import DataValidationError

    try:
        shard = parse_shard(args.shard)
        if args.stage in ("all", "plan", "generate"):
            plan = load_or_make_plan(cfg)
            c = plan.info["clusters"]
            print(f"plan: {plan.info['corpus']['entries_kept']} entries, {c['count']} clusters "
                  f"({c['backend']}), {len(plan.sets)} image sets -> {cfg.output.dir}/plan")
        if args.stage in ("all", "generate"):
            stats = generate_shard(cfg, plan, shard, progress=not args.no_progress)
            print(f"shard {shard[0]}/{shard[1]}: " + json.dumps(stats["outcomes"]) + "; teacher " +
                  json.dumps({k: stats["teacher"][k] for k in ("calls", "completed", "cache_hits", "failed", "cost_usd")}))
        if args.stage == "merge" or (args.stage == "all" and shard[1] == 1):
            stats = merge(cfg, args.shards or shard[1])
            print(render_stats(stats))
            print(verify_output(cfg))
            print(f"dataset: {cfg.output.dir}/mmdu.json  (check: mmtune data check {cfg.output.dir}/data.yaml --strict)")
    except (BuildError, DataValidationError, FileNotFoundError, ImportError) as e:
        print(f"mmtune data build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
