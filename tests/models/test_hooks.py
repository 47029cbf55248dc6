"""The one set of model hooks (models/hooks.py) of the LLaVA, Qwen-VL and auto families: the dummy
vision pass of a text-only step reaches exactly the vision and projector parameters a real image
step reaches (DDP expects the same parameters used on every rank), with zero gradients."""

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import encode_example
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from tests.support import auto_checkpoints


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "red.png"
    PILImage.new("RGB", (64, 48), (255, 0, 0)).save(path)
    return str(path)


def _adapter(case):
    if case == "auto-qwen3_vl_moe":  # Qwen3-VL's DeepStack mergers feed the decoder too
        return auto_checkpoints.adapter("qwen3_vl_moe")
    family, _, model_type = case.partition("-")
    return build_adapter(ModelConfig(family=family, architecture={"model_type": model_type} if model_type else {}))


def _vision_names(adapter, model):
    groups = adapter.module_groups(model)
    names = {id(p) for m in groups.vision + groups.projector for p in m.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in names}


def _reached(model, names):
    return {n for n, p in model.named_parameters() if n in names and p.grad is not None}


@pytest.mark.parametrize("case", ["llava", "qwen2_vl-qwen2_vl", "qwen2_vl-qwen3_vl", "auto-qwen3_vl_moe"])
def test_dummy_vision_pass_reaches_what_an_image_step_reaches(case, image):
    adapter = _adapter(case)
    model = adapter.load_model()
    names = _vision_names(adapter, model)
    model.zero_grad(set_to_none=True)
    dummy = adapter.vision_dummy_loss(model)
    dummy.backward()
    assert dummy.item() == 0.0
    by_dummy = {n: p.grad for n, p in model.named_parameters() if n in names and p.grad is not None}
    assert all(torch.count_nonzero(grad) == 0 for grad in by_dummy.values())
    model.zero_grad(set_to_none=True)
    dialogue = Dialogue("d", "t", (Turn("user", (Image(image), "What colour?")), Turn("assistant", ("Red.",))))
    example = encode_example(adapter, dialogue, max_length=None)
    ids, labels = torch.tensor([example.input_ids]), torch.tensor([example.labels])
    inputs = adapter.image_inputs([r.path for r in example.images])
    extra = {"position_ids": adapter.position_ids(ids[0], inputs)[:, None]} if adapter.position_id_rows > 1 else {}
    model(input_ids=ids, labels=labels, use_cache=False, **inputs, **extra).loss.backward()
    by_image = _reached(model, names)
    model.zero_grad(set_to_none=True)
    assert by_image and set(by_dummy) == by_image
