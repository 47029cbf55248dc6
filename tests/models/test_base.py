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
    with pytest.raises(TypeError, match=r"expected a Linear \(possibly wrapped by peft or a distributed engine\), got _Engine"):
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


def test_input_join_concatenates_or_stacks_padding_the_other_axes():
    from mmtune.models.base import InputJoin

    a, b = torch.ones(2, 3), torch.full((1, 5), 2.0)
    joined = InputJoin(axis=0).join([a, b])
    assert joined.shape == (3, 5) and torch.equal(joined[:2, :3], a) and torch.equal(joined[2], b[0])
    assert joined[:2, 3:].abs().sum() == 0  # padding with pad_value 0
    along_one = InputJoin(axis=1, pad_value=-1.0).join([torch.ones(1, 2, 4), torch.ones(1, 3, 2)])
    assert along_one.shape == (1, 5, 4) and (along_one[0, 2:, 2:] == -1).all()
    stacked = InputJoin(stack=True).join([torch.ones(2, 2), torch.ones(3, 1)])
    assert stacked.shape == (2, 3, 2) and stacked[0, 2].abs().sum() == 0 and stacked[1, :, 1].abs().sum() == 0
    with pytest.raises(ValueError, match=r"\[1, 2\] dimensions"):
        InputJoin().join([torch.ones(2), torch.ones(2, 2)])


def test_join_image_inputs_follows_the_declared_joins_and_names_undeclared_inputs():
    adapter = build_adapter(ModelConfig(family="llava"))
    parts = [{"pixel_values": torch.ones(1, 3, 4, 4)}, {"pixel_values": torch.zeros(2, 3, 4, 4)}]
    assert adapter.join_image_inputs(parts)["pixel_values"].shape == (3, 3, 4, 4)  # default: dim 0
    with pytest.raises(ValueError, match=r"image inputs 1 hold \['image_sizes', 'pixel_values'\].*undeclared \['image_sizes'\]"):
        adapter.join_image_inputs([parts[0], {**parts[1], "image_sizes": torch.ones(2, 2)}])
