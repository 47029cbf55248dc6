"""``mmtune data build CONFIG``: corpus -> clusters -> image sets -> teacher dialogues -> MMDU JSON.

CONFIG is a YAML file or a name under ``configs/build/``; ``key=value`` arguments
override it (``output.dir=out teacher.concurrency=32``).

Examples::

    mmtune data build demo output.dir=/tmp/built          # plan, generate, merge
    mmtune data build my_corpus.yaml --stage plan         # once, before a slurm array
    mmtune data build my_corpus.yaml --shard $SLURM_ARRAY_TASK_ID/8
    mmtune data build my_corpus.yaml --stage merge --shards 8

The teacher is any OpenAI-compatible chat endpoint, hosted or local (a vLLM or
llama.cpp server: docs/data_building.md, "A local teacher"), named by
MMTUNE_TEACHER_BASE_URL / MMTUNE_TEACHER_MODEL / MMTUNE_TEACHER_API_KEY or ``teacher.*``.
Before anything is embedded, a build that will generate checks that a teacher is
configured and answers a one-token request. Skipped corpus entries are listed with
their reasons; calls show as a progress bar, not one log line per HTTP request.

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


def check_teacher(cfg) -> str:
    """The teacher's start-up line, after making sure one is configured and answers.

    Raises:
        BuildError: no teacher model is set, or the endpoint fails a one-token request;
            the message says what to set (a local server's variables included).
    """
    from mmtune.data.build.pipeline import BuildError
    from mmtune.data.build.teacher import teacher_client
    from mmtune.evaluation.judge.client import JudgeError

    t = cfg.teacher
    try:
        client = teacher_client(t, cache_path=None)
    except JudgeError:
        raise BuildError(
            f"no teacher configured: set teacher.model in the build config or ${t.model_env} (and "
            f"${t.base_url_env} for a server other than api.openai.com, e.g. a local vLLM or llama.cpp server at "
            f"http://localhost:8000/v1; docs/data_building.md, 'A local teacher'). Nothing was embedded or sent."
        ) from None
    try:
        client.check()
    except JudgeError as err:
        raise BuildError(f"{err}. Nothing was embedded or sent to it.") from None
    finally:
        client.close()
    return client.describe("teacher")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # one log line per HTTP request would bury the progress bar and the report
    for name in ("httpx", "httpcore", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
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
        if args.stage in ("all", "generate"):  # before embedding anything: is there a teacher to ask?
            print(check_teacher(cfg), flush=True)
        if args.stage in ("all", "plan", "generate"):
            from mmtune.data.build.corpus import CorpusReport

            plan = load_or_make_plan(cfg)
            print(CorpusReport(**plan.info["corpus"]).render())  # what was read, and every skip with its reason
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
