"""The one compose helper: a recipe's config as the recipe sees it, from Hydra overrides."""

from omegaconf import OmegaConf

from mmtune.compose import RECIPES, compose_config


def test_sft_and_evaluate_take_experiment_either_way():
    plain = compose_config(["experiment=demo"])
    plus = compose_config(["+experiment=demo"])
    assert OmegaConf.to_container(plain) == OmegaConf.to_container(plus)
    assert plain.synthetic.enabled is True and plain.model.family == "llava"
    evaluation = compose_config(["experiment=table5_baseline_2k"], config_name="evaluate")
    assert evaluation.run_name == "table5_baseline_2k" and evaluation.eval.generation.context_length == 2048


def test_every_recipe_names_its_primary_config():
    from mmtune.data.config import configs_dir

    for name, script in RECIPES.items():
        assert (configs_dir() / f"{name}.yaml").is_file() and script == f"recipes/{name}.py"
        assert len(compose_config([], config_name=name)) > 0


import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from mmtune.compose import OverrideError, compose_checked, normalize_overrides  # noqa: E402
from tests.support.experiments import declared_recipe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# (overrides, recipe, what the one-line message must say)
BAD_OVERRIDES = [
    (["training.epoch=2"], "sft",
     "unknown config key 'training.epoch' (closest: training.epochs); the keys under training are the fields of "
     "mmtune.training.config.TrainingConfig"),
    (["trainin.lr=1"], "sft", "unknown config key 'trainin' (closest: training); the keys at the top level"),
    (["lr=1e-4"], "sft", "unknown config key 'lr' (closest: training.lr)"),  # a known leaf under another section
    (["eval.generation.max_new_token=3"], "sft", "(closest: eval.generation.max_new_tokens)"),
    (["eval.mmdu.data_pth=x"], "evaluate", "(closest: eval.mmdu.data_path); the keys under eval.mmdu are the fields "
     "of mmtune.evaluation.benchmarks.mmdu.MMDUConfig"),
    (["checkpont=x"], "evaluate", "(closest: checkpoint)"),
    (["model=llava_tin"], "sft", "no model config 'llava_tin' (closest: llava_tiny); the choices are the files in "
     "configs/model/ ("),
    (["experiment=dmeo"], "sft", "no experiment config 'dmeo' (closest: demo); the choices are the files in "
     "configs/experiment/ ("),
    (["training.lr=fast"], "sft", "training.lr: Value 'fast' of type 'str' could not be converted to Float"),
    (["+training.lr=1"], "sft", "training.lr is already in the config: set it with training.lr=VALUE (no +)"),
    (["training.lr"], "sft", "cannot read the override 'training.lr': write key=value"),
    (["experiment=table3_llava15_7b_mmdu45k_eval"], "sft",
     "experiment 'table3_llava15_7b_mmdu45k_eval' is an evaluation experiment (configs/experiment/"
     "table3_llava15_7b_mmdu45k_eval.yaml has recipe: evaluate, run by recipes/evaluate.py), not one for mmtune "
     "train: run it with `mmtune evaluate experiment=table3_llava15_7b_mmdu45k_eval`"),
    (["+experiment=demo"], "evaluate", "experiment 'demo' is a training experiment (configs/experiment/demo.yaml "
     "has recipe: sft, run by recipes/sft.py), not one for mmtune evaluate: run it with `mmtune train "
     "experiment=demo`"),
]


@pytest.mark.parametrize("overrides, recipe, expected", BAD_OVERRIDES, ids=lambda v: str(v)[:40])
def test_a_bad_override_is_one_short_line_naming_the_key_and_the_fix(overrides, recipe, expected):
    with pytest.raises(OverrideError) as info:
        compose_checked(overrides, recipe)
    message = str(info.value)
    assert expected in message
    assert "Traceback" not in message and "full_key" not in message and "object_type" not in message
    assert len(message.splitlines()) == 1


def test_experiment_is_spelled_for_each_recipe_and_every_experiment_names_its_recipe():
    assert normalize_overrides(["+experiment=demo", "training.lr=1"], "sft") == ["experiment=demo", "training.lr=1"]
    assert normalize_overrides(["experiment=x_eval"], "evaluate") == ["+experiment=x_eval"]
    from mmtune.data.config import configs_dir

    for path in sorted((configs_dir() / "experiment").glob("*.yaml")):
        recipe = declared_recipe(path.stem)  # its typed `recipe` key (tests/test_experiment.py: as composed)
        # either entry point composes it the same way; the other refuses with the right command
        assert compose_checked([f"experiment={path.stem}"], recipe) is not None
        other = "evaluate" if recipe == "sft" else "sft"
        with pytest.raises(OverrideError, match=rf"`mmtune {'train' if recipe == 'sft' else 'evaluate'} experiment="):
            compose_checked([f"+experiment={path.stem}"], other)


@pytest.mark.parametrize("script, args, expected", [
    ("recipes/sft.py", ["training.epoch=2"], "recipes/sft.py: unknown config key 'training.epoch' (closest: training.epochs)"),
    # one process each: the default suite starts the first, the others run with the slow tests
    pytest.param("recipes/evaluate.py", ["experiment=demo"], "run it with `mmtune train experiment=demo`",
                 marks=pytest.mark.slow),
    pytest.param("recipes/evaluate.py", ["+eval.judge.modl=x"], "eval.judge.modl (did you mean eval.judge.model?)",
                 marks=pytest.mark.slow),
])
def test_the_recipes_answer_a_typo_with_one_message_and_status_2(script, args, expected):
    proc = subprocess.run([sys.executable, script, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
