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
