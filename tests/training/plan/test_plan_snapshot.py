"""`mmtune plan`'s figures for every shipped experiment, against a snapshot taken before the
plan's memory model moved into the engines: refactors of the plan and the engines print
the same numbers (memory per GPU, steps, tokens, GPU-hours) as before.

Regenerate (only when a figure is meant to change, and say why in the commit):
``MMTUNE_UPDATE_PLAN_SNAPSHOT=1 pytest tests/training/plan/test_plan_snapshot.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mmtune.training.plan import PlanError, plan_evaluation, plan_run
from tests.support.experiments import declared_recipe

REPO = Path(__file__).resolve().parents[3]
SNAPSHOT = Path(__file__).with_name("plan_snapshot.json")
EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml"))


def _overrides(experiment: str, root: Path) -> list[str]:
    """The experiment, its output under the stand-in tree, and its synthetic data generated
    there first when the experiment generates its own (the demos, the tiny Table 5 runs)."""
    from mmtune.compose import compose_checked
    from mmtune.data.synthetic import generate_synthetic

    overrides = [f"experiment={experiment}", f"training.output_dir={root}/outputs/{experiment}"]
    if declared_recipe(experiment) == "evaluate":
        return [f"experiment={experiment}"]
    syn = compose_checked(overrides, "sft", command="test").synthetic
    if syn.enabled and not (Path(syn.out_dir) / "train.json").is_file():
        generate_synthetic(syn.out_dir, n_train=syn.n_train, n_test=syn.n_test, n_llava=syn.n_llava, seed=syn.seed,
                           image_size=syn.image_size, **dict(syn.options))
    return overrides


def _figures(experiment: str, root: Path) -> dict:
    """The rendered plan with the stand-in tree's folder replaced, or the reason it cannot be planned."""
    overrides = _overrides(experiment, root)
    try:
        if declared_recipe(experiment) == "evaluate":
            plan = plan_evaluation(overrides, gpu="a100-80g", num_gpus=8)
        else:  # planned for its own launcher and that launcher's process count, as `mmtune plan` does
            plan = plan_run(overrides, num_gpus=None, gpu="a100-80g")
    except PlanError as err:
        return {"cannot_plan": str(err).replace(str(root), "<root>").splitlines()[0]}
    text = plan.render().replace(str(root), "<root>").replace(str(REPO), "<repo>")
    figures = {"render": text.splitlines()}
    cost = getattr(plan, "cost", None)
    if cost:
        figures["memory_gib"] = cost["memory_gib"]
    elif getattr(plan, "memory_gib", None):
        figures["memory_gib"] = plan.memory_gib
    return figures


@pytest.fixture(scope="module")
def snapshot() -> dict:
    return json.loads(SNAPSHOT.read_text(encoding="utf-8")) if SNAPSHOT.exists() else {}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_plan_prints_the_snapshot_figures(env, experiment: str, snapshot: dict):
    got = _figures(experiment, env)
    if os.environ.get("MMTUNE_UPDATE_PLAN_SNAPSHOT"):
        data = json.loads(SNAPSHOT.read_text(encoding="utf-8")) if SNAPSHOT.exists() else {}
        data[experiment] = got
        SNAPSHOT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        return
    assert experiment in snapshot, f"{experiment}: no snapshot; regenerate as the module docstring says"
    assert got == snapshot[experiment]
