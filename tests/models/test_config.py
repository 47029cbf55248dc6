"""A model config key that the chosen family would not read is refused at start-up, by name."""

import dataclasses
import json

import pytest

from mmtune.models.config import FAMILY_KEYS, ModelConfig
from mmtune.models.registry import adapter_class, build_adapter

# a value that sets each family-specific key (none of them is the unset default)
SET = {"architecture": {"text_config": {"hidden_size": 64}}, "image_aspect_ratio": "resize", "image_size": 56,
       "label_final_eos": False, "min_pixels": 784, "max_pixels": 50176}
FAMILIES = ("llava", "auto", "internlm_xcomposer2", "qwen2_vl")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_every_family_key_is_read_or_refused(family, key):
    reads = adapter_class(family).reads_model_keys
    config = ModelConfig(family=family, **{key: SET[key]})
    if key in reads:
        config.validate()  # read: accepted
    else:
        with pytest.raises(ValueError, match=rf"model\.{key}=.* is not read by model\.family='{family}'"):
            config.validate()


def test_the_issue_cases_are_refused_with_every_problem_listed():
    with pytest.raises(ValueError) as info:
        ModelConfig(family="auto", path="/ckpt", image_aspect_ratio="resize", image_size=336,
                    architecture={"text_config": {}}, label_final_eos=False).validate()
    message = str(info.value)
    for key in ("image_aspect_ratio", "image_size", "architecture", "label_final_eos"):
        assert f"model.{key}=" in message
    with pytest.raises(ValueError, match="model.image_aspect_ratio='pad' is not read by model.family='internlm_xcomposer2'"):
        build_adapter(ModelConfig(family="internlm_xcomposer2", image_aspect_ratio="pad"))


def test_unset_keys_mean_the_family_default():
    llava = build_adapter(ModelConfig(family="llava"))
    assert llava.image_transform.pad  # LLaVA-1.5 pads to a square
    assert ModelConfig().set_family_keys() == []


def test_saved_configs_of_older_runs_drop_keys_their_family_does_not_read(tmp_path):
    """A run saved before these keys were refused recorded every default; loading it drops them."""
    from mmtune.evaluation.generation.loading import _model_config_from

    saved = dataclasses.asdict(ModelConfig(family="internlm_xcomposer2"))
    saved.update(image_aspect_ratio="resize", label_final_eos=True)
    metadata = json.loads(json.dumps({"family": "internlm_xcomposer2", "config": {"model": saved}}))
    config = _model_config_from(metadata, ModelConfig(family="llava", image_aspect_ratio="pad"))
    assert config.image_aspect_ratio is None and config.label_final_eos is True
    config.validate()


def test_a_config_written_as_json_reads_back_with_its_sections_typed():
    """The lmms-eval hand-off writes the model config as JSON; reading it back must give
    ``image_limits`` as its dataclass (a dict would fail validation), and a typo must fail."""
    from mmtune.core.images import ImageLimits

    written = ModelConfig(family="llava", image_limits=ImageLimits(max_side=4096))
    read = ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(written))))
    assert read == written and isinstance(read.image_limits, ImageLimits)
    read.validate()
    with pytest.raises(Exception, match="max_sidee"):
        ModelConfig.from_dict({"family": "llava", "image_limits": {"max_sidee": 1}})
