"""An image input the processor leaves out for an image that has no rows of it (Step3p7's
``pixel_values_local``: no local crops for an image near its 4:3 shape): the adapter's per-image
inputs, joined, equal the processor's call on the same images, with the input left out where no
image has rows of it (was an ``ImageInputError`` at start-up)."""

import pytest
import torch
from PIL import Image as PILImage

from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}<im_patch>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def step3p7(tmp_path_factory):
    from transformers import AutoConfig, Step3p7ImageProcessor, Step3p7Processor

    from mmtune.testing.tokenizers import class_tokenizer

    root = tmp_path_factory.mktemp("step3p7")
    tokenizer = class_tokenizer(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<im_patch>", "<im_start>", "<im_end>",
                                 "<patch_start>", "<patch_end>", "<patch_newline>"),
                                bos=None, eos="<|im_end|>", pad="<|endoftext|>", add_bos=False)
    Step3p7Processor(Step3p7ImageProcessor(), tokenizer, chat_template=TEMPLATE).save_pretrained(root)
    AutoConfig.for_model("step3p7", image_token_id=tokenizer.convert_tokens_to_ids("<im_patch>")).save_pretrained(root)
    adapter = build_adapter(ModelConfig(family="auto", path=str(root)))  # the start-up check passes
    images = {}
    for name, size in {"square": (64, 48), "wide": (120, 30), "tall": (24, 70)}.items():
        images[name] = str(root / f"{name}.png")
        PILImage.new("RGB", size, (30, 120, 200)).save(images[name])
    return adapter, images


@pytest.mark.parametrize("names", [["square"], ["square", "square"], ["wide"], ["square", "wide", "square", "tall"]])
def test_joined_inputs_equal_the_processors_call(step3p7, names):
    adapter, files = step3p7
    images = [PILImage.open(files[n]).convert("RGB") for n in names]
    theirs = adapter.processor(text=[adapter.image_token * len(images)], images=images, return_tensors="pt")
    mine = adapter.image_inputs([files[n] for n in names])
    expected = {k: v for k, v in theirs.items() if k in adapter.image_input_names}
    assert sorted(mine) == sorted(expected)
    for name, value in expected.items():
        assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), name
    # samples join as images do: one sample without local crops beside one with them
    per_sample = [adapter.image_inputs([files[n]]) for n in names]
    joined = adapter.join_image_inputs(per_sample)
    assert sorted(joined) == sorted(expected) and all(torch.equal(joined[k], expected[k]) for k in expected)
