"""The lmms-eval model's engine (``mmtune.evaluation.lmms_model.GenerationEngine``) on the ``auto``
family's tested classes (tiny random-weight checkpoints built from transformers' classes): it
loads the checkpoint directory as lmms-eval's ``pretrained=`` names it, and its reply to a
question with an image is mmtune's own generator's answer, cut at the ``until`` string."""

import pytest
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.evaluation.generation.config import GenerationConfig
from mmtune.evaluation.generation.generator import DialogueGenerator
from mmtune.evaluation.lmms_model import GenerationEngine
from tests.support.auto_checkpoints import cases, checkpoint

QUESTION = "What colour is this image? Answer with one word."


@pytest.mark.parametrize("kind", cases("lmms"))
def test_the_engine_answers_as_mmtunes_generator(kind, tmp_path):
    image = PILImage.new("RGB", (40, 32), "red")
    path = tmp_path / "red.png"
    image.save(path)
    engine = GenerationEngine(pretrained=checkpoint(kind), family="auto", device="cpu")
    assert engine.adapter.family == "auto"
    reply = engine.answer(f"<image>\n{QUESTION}", [image], {"max_new_tokens": 6, "temperature": 0, "until": []})
    own = DialogueGenerator(engine.adapter, engine.model, GenerationConfig(max_new_tokens=6, device="cpu")).generate(
        [Dialogue("q", "t", (Turn("user", (Image(str(path)), "\n", QUESTION)), Turn("assistant", ("",))))])
    assert own[0].new_tokens >= 1
    assert reply == own[0].answer
    if len(reply) > 1:  # `until` cuts at its first occurrence
        stop = reply[1:2]
        cut = engine.answer(f"<image>\n{QUESTION}", [image], {"max_new_tokens": 6, "until": [stop]})
        assert cut == reply[: reply.index(stop)]
