"""The model config: one section per family (``model.<family>``), composed by the registry;
a key the chosen family would not read is refused at start-up, by name; the flat spellings of
the keys that moved still load, with a warning giving the new spelling."""

import dataclasses
import json
import pickle

import pytest
from omegaconf import OmegaConf

from mmtune.models.config import DEPRECATED_FLAT_KEYS, FamilySettings, ModelConfig, model_config_class
from mmtune.models.registry import adapter_class, build_adapter, register_adapter, settings_classes

FAMILIES = ("llava", "auto", "internlm_xcomposer2", "qwen2_vl")
# a value off the default for every key of every built-in family's section
SET = {"image_aspect_ratio": "resize", "image_size": 56, "label_final_eos": False, "min_pixels": 784,
       "max_pixels": 50176, "answer_stop": "eos"}


def test_every_registered_family_has_its_section_typed_by_its_settings_class():
    sections = settings_classes()
    assert set(FAMILIES) <= set(sections)
    config = ModelConfig()
    assert isinstance(config, ModelConfig) and type(config) is model_config_class()
    for family, settings in sections.items():
        assert adapter_class(family).settings_class is settings
        assert isinstance(getattr(config, family), settings) and issubclass(settings, FamilySettings)
    assert type(ModelConfig(family="qwen2_vl").settings) is sections["qwen2_vl"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_set_key_of_another_familys_section_is_refused_naming_what_the_family_reads(family):
    for other, settings in settings_classes().items():
        for f in dataclasses.fields(settings):
            config = ModelConfig(family=family, **{other: {f.name: SET[f.name]}})
            if other == family:
                config.validate()  # its own key: read
                continue
            with pytest.raises(ValueError) as info:
                config.validate()
            message = str(info.value)
            assert f"model.{other}.{f.name}={SET[f.name]!r} is not read by model.family={family!r}" in message
            own = [f"model.{family}.{g.name}" for g in dataclasses.fields(settings_classes()[family])]
            assert ", ".join(own) in message or "no family keys" in message


def test_every_problem_is_listed_at_once():
    with pytest.raises(ValueError) as info:
        ModelConfig(family="auto", path="/ckpt", architecture={"text_config": {}},
                    llava={"image_aspect_ratio": "resize", "image_size": 336},
                    internlm_xcomposer2={"label_final_eos": False}).validate()
    message = str(info.value)
    for key in ("llava.image_aspect_ratio", "llava.image_size", "architecture", "internlm_xcomposer2.label_final_eos"):
        assert f"model.{key}=" in message
    assert "which reads model.auto.answer_stop" in message


def test_values_of_the_chosen_section_are_checked():
    with pytest.raises(ValueError) as info:
        ModelConfig(family="llava", llava={"image_aspect_ratio": "anyres", "image_size": 0}).validate()
    assert "model.llava.image_aspect_ratio='anyres': use 'pad' or 'resize'" in str(info.value)
    assert "model.llava.image_size=0 must be > 0" in str(info.value)


@pytest.mark.parametrize("key", DEPRECATED_FLAT_KEYS)
def test_the_flat_spelling_loads_into_the_section_with_a_warning_naming_the_new_one(key):
    family = next(name for name in ("llava", "internlm_xcomposer2", "qwen2_vl")
                  if key in {f.name for f in dataclasses.fields(settings_classes()[name])})
    with pytest.warns(FutureWarning, match=rf"model\.{key} is deprecated: write model\.{family}\.{key}="):
        config = ModelConfig(family=family, **{key: SET[key]})
    assert getattr(config.settings, key) == SET[key] and getattr(config, key) is None
    config.validate()
    # from YAML too (Hydra merges into the schema, then builds the object)
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig()), {"family": family, key: SET[key]})
    with pytest.warns(FutureWarning):
        assert getattr(OmegaConf.to_object(merged).settings, key) == SET[key]


def test_a_flat_key_the_family_does_not_read_is_refused_and_a_clash_is_named():
    with pytest.raises(ValueError, match="model.image_aspect_ratio='pad' is not read by model.family='internlm_xcomposer2'"):
        build_adapter(ModelConfig(family="internlm_xcomposer2", image_aspect_ratio="pad"))
    with pytest.raises(ValueError, match="model.image_size=224 and model.llava.image_size=336 are both set"):
        ModelConfig(family="llava", image_size=224, llava={"image_size": 336}).validate()


def test_unset_keys_mean_the_family_default():
    llava = build_adapter(ModelConfig(family="llava"))
    assert llava.image_transform.pad  # LLaVA-1.5 pads to a square
    assert ModelConfig().unread_keys() == []


def test_a_section_typo_fails_at_start_up():
    with pytest.raises(Exception, match="max_pixel"):
        ModelConfig.from_dict({"family": "qwen2_vl", "qwen2_vl": {"max_pixel": 1000}})
    with pytest.raises(Exception, match="max_pixel"):
        ModelConfig(family="qwen2_vl", qwen2_vl={"max_pixel": 1000})


def test_saved_configs_of_older_runs_drop_keys_their_family_does_not_read(tmp_path):
    """A run saved before the sections wrote every family key flat (and every default);
    loading it moves the keys its family reads into the section and drops the others."""
    import warnings

    from mmtune.evaluation.generation.loading import _model_config_from

    saved = {"family": "internlm_xcomposer2", "path": None, "architecture": {}, "image_aspect_ratio": "resize",
             "image_size": None, "label_final_eos": True, "min_pixels": None, "max_pixels": None}
    metadata = json.loads(json.dumps({"family": "internlm_xcomposer2", "config": {"model": saved}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a saved file is not the user's spelling
        config = _model_config_from(metadata, ModelConfig(family="llava", llava={"image_aspect_ratio": "pad"}))
    assert config.image_aspect_ratio is None and config.settings.label_final_eos is True
    assert config.llava == settings_classes()["llava"]()  # the caller's other-family section is dropped
    config.validate()
    # a run saved now round-trips
    now = ModelConfig(family="qwen2_vl", qwen2_vl={"max_pixels": 50176})
    again = _model_config_from({"family": "qwen2_vl", "config": {"model": dataclasses.asdict(now)}}, ModelConfig())
    assert again.settings.max_pixels == 50176


def test_a_config_written_as_json_reads_back_with_its_sections_typed():
    """The lmms-eval hand-off writes the model config as JSON; reading it back must give
    ``image_limits`` and the family sections as their dataclasses, and a typo must fail."""
    from mmtune.core.images import ImageLimits

    written = ModelConfig(family="llava", image_limits=ImageLimits(max_side=4096), llava={"image_size": 336})
    read = ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(written))))
    assert read == written and isinstance(read.image_limits, ImageLimits)
    assert read.settings.image_size == 336
    assert pickle.loads(pickle.dumps(read)) == read
    read.validate()
    with pytest.raises(Exception, match="max_sidee"):
        ModelConfig.from_dict({"family": "llava", "image_limits": {"max_sidee": 1}})


def test_a_new_family_brings_its_section_without_an_edit_of_the_model_config():
    from mmtune.models import registry
    from mmtune.models.llava import LlavaAdapter

    @dataclasses.dataclass
    class ToySettings(FamilySettings):
        depth: int = 1
        """How deep."""

    class ToyAdapter(LlavaAdapter):
        family = "toy_family"
        settings_class = ToySettings

    register_adapter(ToyAdapter)
    try:
        config = ModelConfig(family="toy_family", toy_family={"depth": 3})
        assert config.settings == ToySettings(depth=3)
        config.validate()
        with pytest.raises(ValueError, match=r"model.toy_family.depth=3 is not read by model.family='llava'"):
            ModelConfig(family="llava", toy_family={"depth": 3}).validate()
    finally:
        registry._ADAPTERS.pop("toy_family")

    class NoSettings(LlavaAdapter):
        family = "no_settings"
        settings_class = None

    with pytest.raises(ValueError, match="set `settings_class`"):
        register_adapter(NoSettings)
