"""``mmtune plan``: plan one run (training or evaluation) or every run of a sweep, and print the plans.

Examples::

    mmtune plan experiment=table5_mmdu45k_8k --gpus 8 --gpu a100-80g
    mmtune plan --gpu h100 experiment=table3_llava15_7b_mmdu45k training.lr=1e-4    # flags first or last
    mmtune plan --sweep launch/sweeps/table5.yaml --gpu h100
    mmtune plan --sweep launch/sweeps/table5.yaml --list      # one override line per run

A run is planned for the launcher its config names (the experiment's typed ``launcher``
key: the accelerate config file of the command that runs it) unless ``--accelerate-config``
gives another; the plan says which it used, or that it assumed plain DDP. Which recipe an
experiment is planned as comes from its ``recipe`` key (``sft`` or ``evaluate``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Optional, Sequence

from mmtune.compose import RECIPES
from mmtune.io.nofollow import write_output_text
from mmtune.training.plan import cost
from mmtune.training.plan.common import PlanError
from mmtune.training.plan.evaluation import plan_evaluation
from mmtune.training.plan.gpus import GPU_TYPES
from mmtune.training.plan.run import RunPlan, plan_run
from mmtune.training.plan.sweeps import experiment_recipe, sweep_accelerate_config, sweep_grid, sweep_recipe

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mmtune.argparsing import ArgumentParser, plain_text

    parser = ArgumentParser(
        prog="mmtune plan",
        description="Resolve a run or a sweep without loading weights; print model, data, steps, tokens, "
        "GPU-hours and memory per GPU. Positional arguments are Hydra overrides (experiment=...), before or after "
        "the flags. A run is planned for the launcher its experiment names (its `launcher` key), unless "
        "--accelerate-config says otherwise.",
        epilog=plain_text("Cost model" + cost.__doc__.split("Cost model", 1)[1]) if cost.__doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. experiment=table5_mmdu45k_8k")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                        help="which recipe the run is for: sft or evaluate; default: the experiment's `recipe` key "
                        "(sft without an experiment); a sweep's `program` decides for --sweep")
    parser.add_argument("--sweep", help="a W&B sweep YAML (launch/sweeps/*.yaml): plan every grid point")
    parser.add_argument("--list", action="store_true", help="with --sweep: print each grid point's overrides and exit")
    parser.add_argument("--gpus", type=int, default=None,
                        help="data-parallel GPUs in total (default: the launcher's num_processes, else 8); for an "
                             "evaluation, the processes that split its dialogues")
    parser.add_argument("--gpu", default="a100-80g", choices=sorted(GPU_TYPES), help="GPU type (default a100-80g)")
    parser.add_argument("--utilization", type=float, default=0.35,
                        help="assumed fraction of peak bf16 FLOP/s achieved, recompute included (default 0.35)")
    parser.add_argument("--accelerate-config", help="accelerate config whose engine settings and process count "
                        "the run uses (a relative path: from the current folder, else from the project); default: "
                        "the experiment's `launcher` key")
    parser.add_argument("--allow-skipped", action="store_true",
                        help="plan even if records would be skipped for missing or broken images")
    parser.add_argument("--json", help="also write the plans as JSON to this file")
    # overrides may come before, between or after the flags
    args = parser.parse_intermixed_args(list(argv) if argv is not None else None)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    accelerate_config = args.accelerate_config
    recipe = args.recipe or "sft"
    if args.sweep:
        try:
            points = [p + list(args.overrides) for p in sweep_grid(args.sweep)]
            accelerate_config = accelerate_config or sweep_accelerate_config(args.sweep)
            recipe = args.recipe or sweep_recipe(args.sweep)
        except (ValueError, OSError) as err:
            print(f"mmtune plan: {args.sweep}: {err}", file=sys.stderr)
            return 2
    elif args.overrides:
        points = [list(args.overrides)]
        recipe = args.recipe or experiment_recipe(args.overrides)
    else:
        parser.print_usage(sys.stderr)
        print("mmtune plan: give Hydra overrides (experiment=...) or --sweep FILE", file=sys.stderr)
        return 2
    if args.list:
        for p in points:
            print(" ".join(p))
        return 0

    plans, failures = [], []
    for point in points:
        try:
            if recipe == "evaluate":
                plan = plan_evaluation(point, gpu=args.gpu, num_gpus=args.gpus or 8)
            else:
                plan = plan_run(point, num_gpus=args.gpus, gpu=args.gpu, utilization=args.utilization,
                                accelerate_config=accelerate_config, allow_skipped=args.allow_skipped)
        except PlanError as err:
            failures.append(str(err))
            print(f"== run [{' '.join(point)}]: CANNOT START\n{err}\n", file=sys.stderr)
            continue
        plans.append(plan)
        print(plan.render() + "\n")
    if len(points) > 1:
        total = sum(p.cost["gpu_hours"] for p in plans if isinstance(p, RunPlan) and p.cost)
        print(f"== {len(plans)} runs planned, {len(failures)} cannot start"
              + (f"; ~{total:.1f} GPU-hours of training in total" if recipe == "sft" else ""))
    if args.json:
        write_output_text(args.json, json.dumps([asdict(p) for p in plans], indent=2, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
