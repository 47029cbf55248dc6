"""Generation computes logits for the last position only, never for the whole prompt."""

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.evaluation.config import GenerationConfig
from mmtune.evaluation.generation.generator import DialogueGenerator
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter


@pytest.mark.parametrize("family", ["llava", "internlm_xcomposer2"])
@pytest.mark.parametrize("kv_reuse", [True, False])
def test_output_head_sees_one_position_per_row(family, kv_reuse, tmp_path):
    adapter = build_adapter(ModelConfig(family=family))
    torch.manual_seed(0)
    model = adapter.load_model(seed=0) if family == "llava" else adapter.load_model()
    model.eval()
    path = tmp_path / "a.png"
    PILImage.new("RGB", (40, 30), "red").save(path)
    dialogue = Dialogue("d0", "test", (
        Turn("user", ("Image1: ", Image(str(path)), ". What colour is it?")), Turn("assistant", ("red",)),
        Turn("user", ("And now?",)), Turn("assistant", ("still red",)),
    ))
    _, head = adapter.loss_modules(model)
    positions = []
    handle = head.register_forward_pre_hook(lambda _m, args: positions.append(args[0].shape[1]))
    try:
        records = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=4, kv_reuse=kv_reuse)
                                    ).generate([dialogue])
    finally:
        handle.remove()
    assert len(records) == 2 and all(r.prompt_tokens > 20 for r in records)
    assert positions and set(positions) == {1}
