"""What the adapter contract gives every family for free: unwrapping, module groups, the meta-device model."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from mmtune.models.base import find_module_groups, unwrap_model
from mmtune.models.config import ModelConfig
from mmtune.models.registry import adapter_class, build_adapter


class _Engine(torch.nn.Module):
    """Wraps a model in ``module`` as DDP and DeepSpeed's engine do."""

    def __init__(self, module):
        super().__init__()
        self.module = module


@pytest.fixture(scope="module", params=["llava", "internlm_xcomposer2"])
def family(request):
    adapter = build_adapter(ModelConfig(family=request.param))
    return adapter, adapter.load_model()


def _params(modules):
    return {id(p) for m in modules for p in m.parameters()}


def test_unwrap_finds_the_model_in_every_wrapper(family):
    adapter, model = family
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=adapter.default_lora_targets[:1],
                                            exclude_modules=adapter.lora_exclude_modules))
    for wrapped in (model, lora, _Engine(lora), _Engine(_Engine(model))):
        assert unwrap_model(wrapped) is model
        assert unwrap_model(wrapped, type(model)) is model
    lora.unload()  # the module-scoped model stays as built


def test_unwrap_names_the_expected_class_when_it_is_not_inside(family):
    _, model = family
    with pytest.raises(TypeError, match=r"expected a Linear \(possibly wrapped by peft/DDP/DeepSpeed\), got _Engine"):
        unwrap_model(_Engine(model), torch.nn.Linear)


def test_module_groups_cover_every_parameter_once_through_wrappers(family):
    adapter, model = family
    groups = adapter.module_groups(_Engine(model))
    parts = [_params(groups.vision), _params(groups.projector), _params(groups.language_model)]
    assert all(parts) and sum(len(p) for p in parts) == len(set().union(*parts)) == len(list(model.parameters()))


def test_attribute_name_groups_of_a_transformers_model_match_the_llava_adapter():
    adapter = build_adapter(ModelConfig(family="llava"))
    model = adapter.load_model()
    found, own = find_module_groups(_Engine(model)), adapter.module_groups(model)
    for name in ("vision", "projector", "language_model"):
        assert _params(getattr(found, name)) == _params(getattr(own, name))
    with pytest.raises(ValueError, match="cannot find the vision tower of Linear"):
        find_module_groups(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["llava", "internlm_xcomposer2"])
def test_meta_model_of_a_random_weight_config_equals_a_real_build(name):
    cfg = ModelConfig(family=name)
    meta, groups = adapter_class(name).meta_model(cfg, None)
    real = build_adapter(cfg).load_model()
    assert all(p.is_meta for p in meta.parameters())
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    assert sum(p.numel() for m in groups.vision for p in m.parameters()) > 0
