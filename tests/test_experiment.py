"""Experiment files state only what differs, and declare how they run in typed keys.

What is counted. A *value* of an experiment file is one leaf of its own YAML body (the
``defaults`` list left out): a dotted key and what the file sets it to, a list counting as
one value (``data.mixture.sources``, ``logging.tags``). ``recipe`` and ``launcher`` are left
out: every experiment declares them, as it shows its command.

- A value is *restated* when the configs the file composes (its ``defaults``: group
  options and a parent experiment) already give that key that value: deleting the line
  would change nothing.
- A value is *repeated where a shared default exists* when the same key is set to the
  same value by two or more experiment files and by a file of a config group
  (``configs/<group>/*.yaml``, the shared defaults experiments compose): those
  experiments should compose that file instead of copying its value.

Both counts must be zero. Values that merely coincide in two experiments without a
shared home (the 8192-token window of two rows, a checkpoint one run trains and another
evaluates) are allowed.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mmtune.compose import RECIPES, compose_config, experiment_recipe
from mmtune.evaluation.config import register_configs as register_evaluate
from mmtune.experiment import Recipe
from mmtune.training.config import register_configs as register_sft
from tests.support.experiments import declared_recipe

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
#: keys every experiment declares rather than inherits from a shared file
DECLARATIONS = {"recipe", "launcher"}
#: the MMDU judge's snapshot, written once (configs/eval/mmdu.yaml)
JUDGE = "gpt-4o-2024-05-13"


def _load(path: Path) -> tuple[list[Any], dict[str, Any]]:
    """(defaults list, body) of a config file."""
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return list(data.pop("defaults", None) or []), data


def _leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def experiment_values(root: Path = CONFIGS) -> dict[str, dict[str, Any]]:
    """Each experiment file's values, ``{name: {dotted key: value}}`` (declarations left out)."""
    out = {}
    for path in sorted((root / "experiment").glob("*.yaml")):
        _, body = _load(path)
        out[path.stem] = {k: v for k, v in _leaves(body) if k.split(".")[0] not in DECLARATIONS}
    return out


def shared_defaults(root: Path = CONFIGS) -> dict[tuple[str, str], list[str]]:
    """``{(dotted key, value): [group files setting it]}`` over every config group file,
    keys placed where the file's package puts them (``<group>.`` unless ``@package _global_``)."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for group in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in ("experiment", "build")):
        for path in sorted(group.rglob("*.yaml")):
            first = path.read_text(encoding="utf-8").splitlines()[:1]
            prefix = "" if first and "@package _global_" in first[0] else f"{group.name}."
            _, body = _load(path)
            for key, value in _leaves(body):
                found[(prefix + key, _text(value))].append(str(path.relative_to(root)))
    return found


def repeated_values(root: Path = CONFIGS) -> list[str]:
    """Every value set by two or more experiment files where a config group file sets the
    same key to the same value; one line per (key, value), naming the files."""
    by_pair: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, values in experiment_values(root).items():
        for key, value in values.items():
            by_pair[(key, _text(value))].append(name)
    shared = shared_defaults(root)
    return [f"{key}={value} in {len(names)} experiments ({', '.join(names)}); shared default in "
            f"{', '.join(shared[(key, value)])}"
            for (key, value), names in sorted(by_pair.items()) if len(names) > 1 and (key, value) in shared]


def base_overrides(name: str, root: Path = CONFIGS) -> list[str]:
    """The overrides that compose what experiment ``name``'s defaults list gives, without its body."""
    defaults, _ = _load(root / "experiment" / f"{name}.yaml")
    overrides = []
    for entry in defaults:
        if entry == "_self_":
            continue
        if isinstance(entry, str):  # a parent experiment of the same group
            overrides.append(f"experiment={entry}")
            continue
        [(key, option)] = entry.items()
        group = key.removeprefix("override").strip().lstrip("/")
        overrides.append(f"{group}={option}" if key.startswith("override") else f"+{group}={option}")
    return overrides


def restated_values(name: str, base: Any, root: Path = CONFIGS) -> list[str]:
    """The values of experiment ``name`` that ``base``, its defaults composed without its body
    (:func:`base_overrides`), already gives it; one line each."""
    restated = []
    for key, value in experiment_values(root)[name].items():
        node = OmegaConf.select(base, key, default="<absent>")
        known = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
        if known != "<absent>" and _text(known) == _text(value):
            restated.append(f"{name}: {key}={_text(value)} is already what its defaults give")
    return restated


def _compose_all(root: Path, overrides: dict[str, list[str]]) -> dict[str, Any]:
    """``configs/sft.yaml`` of ``root`` composed once per entry, in one Hydra context (every
    experiment composes into sft.yaml: its schema holds every section they set)."""
    register_sft()
    register_evaluate()
    with initialize_config_dir(config_dir=str(root), version_base=None):
        return {key: compose("sft", overrides=list(o)) for key, o in overrides.items()}


@pytest.fixture(scope="module")
def experiments() -> dict[str, Any]:
    """Every experiment, composed."""
    return _compose_all(CONFIGS, {name: [f"experiment={name}"] for name in EXPERIMENTS})


@pytest.fixture(scope="module")
def bases() -> dict[str, Any]:
    """Every experiment's defaults list, composed without the experiment's own body."""
    return _compose_all(CONFIGS, {name: base_overrides(name) for name in EXPERIMENTS})


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_an_experiment_states_only_what_its_defaults_do_not_give(name, bases):
    assert restated_values(name, bases[name]) == []


def test_no_value_is_repeated_across_experiments_where_a_shared_default_exists():
    assert repeated_values() == []


def test_the_counts_see_a_restated_and_a_repeated_value(tmp_path):
    # Both checks must be able to fail: two evaluation experiments that write MMDU's judge
    # out again, as they did before the protocol lived in configs/eval/mmdu.yaml.
    root = tmp_path / "configs"
    shutil.copytree(CONFIGS, root)
    for name in ("table5_baseline_4k", "table5_mmdu45k_eval_8k"):
        path = root / "experiment" / f"{name}.yaml"
        path.write_text(path.read_text() + f"  judge:\n    model: {JUDGE}\n")
    assert repeated_values(root) == [
        f'eval.judge.model="{JUDGE}" in 2 experiments (table5_baseline_4k, table5_mmdu45k_eval_8k); '
        "shared default in eval/mmdu.yaml"]
    base = _compose_all(root, {"b": base_overrides("table5_baseline_4k", root)})["b"]
    assert restated_values("table5_baseline_4k", base, root) == [
        f'table5_baseline_4k: eval.judge.model="{JUDGE}" is already what its defaults give']


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_declares_its_recipe_and_launcher(name, experiments):
    defaults, body = _load(CONFIGS / "experiment" / f"{name}.yaml")
    parents = [e for e in defaults if isinstance(e, str) and e != "_self_"]
    assert parents or "recipe" in body, f"{name}.yaml: state `recipe: sft` or `recipe: evaluate`"
    cfg = experiments[name]
    assert isinstance(cfg.recipe, Recipe) and cfg.recipe.value in RECIPES
    assert declared_recipe(name) == cfg.recipe.value  # the tests' reading without composing agrees
    assert cfg.run_name in (None, name), "a row's run is named after its experiment (the report matches on it)"
    if cfg.launcher is not None:
        assert (REPO / cfg.launcher).is_file(), f"{name}: launcher {cfg.launcher} does not exist"
        assert cfg.recipe == Recipe.sft
    for parent in parents:  # a child runs under its parent's recipe
        assert experiments[parent].recipe == cfg.recipe


def test_experiment_recipe_reads_the_typed_key():
    assert experiment_recipe(["experiment=table5_mmdu45k_eval_2k"]) == "evaluate"  # inherited from its base
    assert experiment_recipe(["+experiment=table5_sft_pool", "training.lr=1e-4"]) == "sft"
    assert experiment_recipe(["training.lr=1e-4"]) == "sft"
    cfg = compose_config(["experiment=table5_baseline_2k"], "evaluate")
    assert cfg.recipe == Recipe.evaluate and cfg.launcher is None


def test_changing_the_mmdu_judge_is_one_line(experiments):
    # The snapshot is written on one line of one file ...
    lines = [(str(path.relative_to(CONFIGS)), line.split("#")[0].strip())
             for path in sorted(CONFIGS.rglob("*.yaml")) if path.parts[-2] != "build"  # build/: a data teacher
             for line in path.read_text(encoding="utf-8").splitlines() if JUDGE in line]
    assert lines == [("eval/mmdu.yaml", f"model: {JUDGE}")]
    # ... no experiment sets the judge itself, and every MMDU evaluation gets that line's value.
    assert not [n for n, values in experiment_values().items() if "eval.judge.model" in values]
    judged = {n for n, cfg in experiments.items() if cfg.recipe == Recipe.evaluate and "mmdu" in cfg.eval.benchmarks}
    assert len(judged) == 11
    for name in judged:
        cfg = experiments[name]
        assert cfg.eval.judge.model == JUDGE, name
        if "mmvet" in cfg.eval.benchmarks:  # MM-Vet keeps its own judge
            assert cfg.eval.mmvet.judge_model == "gpt-4-0613"
