"""The eval config's benchmark sections come from the benchmark registry, typed by each benchmark."""

import copy
import dataclasses
import pickle

import pytest
from omegaconf import OmegaConf

from mmtune.evaluation.benchmarks.registry import registered_names, settings_classes
from mmtune.evaluation.config import EvalConfig, EvaluateConfig, eval_config_class, to_evaluate_config
from mmtune.schema_keys import unknown_keys
from mmtune.training.config import SFTConfig


def test_every_registered_benchmark_has_its_typed_section():
    cfg = EvalConfig()
    sections = settings_classes()
    assert set(sections) == set(registered_names()) >= {"synthetic", "mmdu", "mmvet", "mdi", "lmms_eval"}
    for name, settings in sections.items():
        assert type(getattr(cfg, name)) is settings
    assert isinstance(cfg, EvalConfig) and type(cfg) is eval_config_class()


@pytest.mark.parametrize("name", sorted(settings_classes()))
def test_sections_are_in_the_hydra_schema_and_typos_are_caught(name):
    settings = settings_classes()[name]
    key = dataclasses.fields(settings)[0].name
    schema = OmegaConf.structured(EvaluateConfig)
    assert key in schema.eval[name]
    with pytest.raises(Exception, match=f"eval.{name}.{key}_typo"):
        OmegaConf.merge(schema, {"eval": {name: {f"{key}_typo": 1}}})
    # `+eval.<name>.<typo>=...` lifts struct mode in Hydra; the walker still names it
    for schema_class in (EvaluateConfig, SFTConfig):
        assert unknown_keys({"eval": {name: {f"{key}_typo": 1}}}, schema_class) == [
            f"eval.{name}.{key}_typo (did you mean eval.{name}.{key}?)"]


def test_sections_can_be_given_to_the_constructor_and_survive_copies():
    from mmtune.evaluation.benchmarks.mdi import MDIConfig

    cfg = EvalConfig(benchmarks=["mdi"], mdi=MDIConfig(data_path="items.json", alpha=0.25))
    for clone in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert isinstance(clone, EvalConfig) and clone.mdi == cfg.mdi and clone.mdi is not cfg.mdi
    assert dataclasses.replace(cfg, progress=False).mdi == cfg.mdi
    converted = to_evaluate_config(OmegaConf.create(
        {"eval": {"benchmarks": ["mdi"], "mdi": {"data_path": "items.json", "alpha": 0.25}}}))
    assert converted.eval.mdi.alpha == 0.25 and type(converted.eval) is eval_config_class()
