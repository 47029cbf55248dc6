"""Classes of transformers' image-text-to-text list outside the tested set, on processor-only
folders (tiny tokenizer, small image settings, a config; no weights): each either encodes as its
processor does, through ``model.family=auto`` and nothing else, or is refused at start-up with its
reason. What each one exercises:

- MiniCPM-V 4.7: a ``get_rope_index`` that reads ``target_sizes``, not ``image_grid_thw``;
- ERNIE-4.5-VL: a text-aligned input with values on the tokens the template puts around an image
  (``moe_mm_token_type_ids``), which its experts route on;
- QianfanOCR: a template that renders a placeholder (``<image>``) other than ``processor.image_token``;
- Chameleon: a processor that keeps no chat template of its own and appends its separator to every text;
- Mistral 4: a text model listed as image-text-to-text, whose ``forward`` takes no image input.
"""

import numpy as np
import pytest
import torch
from PIL import Image as PILImage
from transformers import AutoConfig
from transformers.image_utils import load_image

from mmtune.core.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import encode_example
from mmtune.models.auto import UnsupportedProcessorError
from mmtune.models.auto.errors import TemplateNotPrefixStableError
from mmtune.models.config import ModelConfig
from mmtune.models.positions import rope_image_params
from mmtune.models.registry import build_adapter
from mmtune.testing.checkpoints import KINDS, tiny_processor
from mmtune.testing.tokenizers import class_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
          "{% if c['type'] == 'image' %}IMAGE{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _save(folder, model_type, processor, **config):
    processor.save_pretrained(folder)
    AutoConfig.for_model(model_type, **config).save_pretrained(folder)
    return str(folder)


def _text(tokenizer, **extra):
    return {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            **extra}


def minicpmv4_7(folder):
    from transformers import MiniCPMV4_6ImageProcessor, MiniCPMV4_6VideoProcessor, MiniCPMV4_7Processor

    spec = KINDS["minicpmv4_6"]
    tok = class_tokenizer(spec.special_tokens, bos=None, eos=spec.eos, pad=spec.pad, named_tokens=spec.named_tokens,
                          add_bos=False)
    processor = MiniCPMV4_7Processor(image_processor=MiniCPMV4_6ImageProcessor(scale_resolution=112, max_slice_nums=2),
                                     video_processor=MiniCPMV4_6VideoProcessor(), tokenizer=tok,
                                     chat_template=spec.template)
    return _save(folder, "minicpmv4_7", processor, image_token_id=tok.convert_tokens_to_ids("<image>"),
                 video_token_id=tok.convert_tokens_to_ids("<video_token>"), text_config=_text(tok))


ERNIE_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}{{- '<|begin_of_sentence|>' -}}"
    "{%- for message in messages -%}{%- if message['role'] in ['system', 'user'] -%}"
    "{%- if message['role'] == 'user' -%}{{- 'User: ' -}}{%- endif -%}"
    "{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- elif item['type'] == 'image' -%}{%- set image_count.value = image_count.value + 1 -%}"
    "Picture {{ image_count.value }}:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
    "{%- endif -%}{%- endfor -%}{{- '\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'Assistant: ' -}}"
    "{%- for item in message['content'] -%}{{- item['text'] -}}{%- endfor -%}{{- '<|end_of_sentence|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}")


def ernie4_5_vl_moe(folder):
    from transformers import Ernie4_5_VLMoeImageProcessor, Ernie4_5_VLMoeProcessor, Ernie4_5_VLMoeVideoProcessor

    named = {"image_token": "<|IMAGE_PLACEHOLDER|>", "image_start_token": "<|IMAGE_START|>",
             "image_end_token": "<|IMAGE_END|>", "video_token": "<|VIDEO_PLACEHOLDER|>",
             "video_start_token": "<|VIDEO_START|>", "video_end_token": "<|VIDEO_END|>"}
    tok = class_tokenizer(("<unk>", "<|begin_of_sentence|>", "<|end_of_sentence|>", *named.values()),
                          bos="<|begin_of_sentence|>", eos="<|end_of_sentence|>", pad="<unk>", named_tokens=named)
    processor = Ernie4_5_VLMoeProcessor(
        image_processor=Ernie4_5_VLMoeImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16}),
        tokenizer=tok, video_processor=Ernie4_5_VLMoeVideoProcessor(draw_on_frames=False), chat_template=ERNIE_TEMPLATE)
    ids = {f"{key}_id": tok.convert_tokens_to_ids(token) for key, token in named.items()}
    return _save(folder, "ernie4_5_vl_moe", processor, **ids, text_config=_text(tok, bos_token_id=tok.bos_token_id))


def qianfan_ocr(folder):
    from transformers import GotOcr2ImageProcessor, QianfanOCRProcessor

    named = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"}
    tok = class_tokenizer(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", *named.values()), bos=None,
                          eos="<|im_end|>", pad="<|endoftext|>", named_tokens=named, add_bos=False)
    processor = QianfanOCRProcessor(image_processor=GotOcr2ImageProcessor(size={"height": 28, "width": 28},
                                                                          max_patches=4),
                                    tokenizer=tok, image_seq_length=4, chat_template=CHATML.replace("IMAGE", "<image>\n"))
    return _save(folder, "qianfan_ocr", processor, image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
                 text_config=_text(tok))


def chameleon(folder):
    from transformers import ChameleonImageProcessor, ChameleonProcessor

    tok = class_tokenizer(("<unk>", "<s>", "</s>", "<pad>", "<reserved08706>", "<image>", "<racm3:break>", "<eoss>"),
                          bos="<s>", eos="</s>", pad="<pad>",
                          named_tokens={"image_token": "<image>", "boi_token": "<racm3:break>", "eoi_token": "<eoss>"})
    tok.sep_token = "<reserved08706>"
    processor = ChameleonProcessor(image_processor=ChameleonImageProcessor(size={"shortest_edge": 32},
                                                                           crop_size={"height": 32, "width": 32}),
                                   tokenizer=tok, image_seq_length=4)
    processor.chat_template = CHATML.replace("IMAGE", "<image>")  # its __init__ takes none: the tokenizer keeps it
    return _save(folder, "chameleon", processor, **_text(tok, bos_token_id=tok.bos_token_id),
                 image_token_id=tok.convert_tokens_to_ids("<image>"))


def mistral4(folder):
    spec = KINDS["mistral3"]
    tok = class_tokenizer(spec.special_tokens, bos=spec.bos, eos=spec.eos, pad=spec.pad, named_tokens=spec.named_tokens,
                          add_bos=spec.add_bos)
    return _save(folder, "mistral4", tiny_processor("mistral3", tok), hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 **_text(tok, bos_token_id=tok.bos_token_id))


@pytest.fixture(scope="module")
def dialogues(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for k, (width, height) in enumerate([(40, 30), (24, 70), (64, 64), (90, 25)]):
        path = folder / f"img{k}.png"
        PILImage.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(path)
        paths.append(Image(str(path)))
    return [
        Dialogue("two-exchanges", "test", (
            Turn("user", (paths[0], "What is shown?")), Turn("assistant", ("A square.",)),
            Turn("user", ("Compare ", paths[1], " and ", paths[2], ".")), Turn("assistant", ("The first is taller.",)))),
        Dialogue("system-adjacent", "test", (
            Turn("system", ("Answer briefly.",)), Turn("user", (paths[3], paths[1], " Both?")),
            Turn("assistant", ("Yes.",)))),
    ]


def _processor_call(adapter, dialogue):
    messages = [{"role": t.role, "content": [{"type": "image"} if isinstance(s, Image) else {"type": "text", "text": s}
                                             for s in t.segments]} for t in dialogue.turns]
    text = adapter.processor.apply_chat_template(messages, tokenize=False)
    bos = adapter.tokenizer.bos_token
    kwargs = {"add_special_tokens": False} if bos is not None and text.startswith(bos) else {}
    paths = [image.path for turn in dialogue.turns for image in turn.images]
    return paths, adapter.processor(text=[text], images=[load_image(p) for p in paths], return_tensors="pt", **kwargs)


@pytest.mark.parametrize("build", [minicpmv4_7, ernie4_5_vl_moe, qianfan_ocr], ids=lambda b: b.__name__)
def test_unnamed_classes_encode_as_their_processor(build, dialogues, tmp_path):
    adapter = build_adapter(ModelConfig(family="auto", path=build(tmp_path)))
    for dialogue in dialogues:
        paths, theirs = _processor_call(adapter, dialogue)
        ids = theirs["input_ids"][0]
        example = encode_example(adapter, dialogue, max_length=None)
        assert example.input_ids[:len(ids)] == ids.tolist(), dialogue.id
        mine = adapter.image_inputs(paths)
        for name in adapter.image_input_names:
            assert torch.equal(mine[name], theirs[name]), (dialogue.id, name)
        for name, values in adapter.token_inputs(ids[None]).items():
            assert torch.equal(values, theirs[name].long()), (dialogue.id, name)
        if adapter._rope is not None:  # as the model's forward computes them from the processor's call
            given = {name: theirs[name] for name in rope_image_params(adapter._rope.model_class) if name in theirs}
            marks = (ids[None] == adapter.image_token_id).int()
            want = adapter._rope.model.get_rope_index(ids[None], mm_token_type_ids=marks, **given)[0][:, 0]
            assert torch.equal(adapter.position_ids(ids, mine), want), dialogue.id


def test_minicpmv4_7_positions_read_its_target_sizes(tmp_path):
    adapter = build_adapter(ModelConfig(family="auto", path=minicpmv4_7(tmp_path)))
    assert adapter._rope.image_params == ("target_sizes",) and "target_sizes" in adapter.image_input_names


def test_ernie_expert_routing_marks_the_image_wrappers(tmp_path):
    adapter = build_adapter(ModelConfig(family="auto", path=ernie4_5_vl_moe(tmp_path)))
    marked = {adapter.tokenizer.convert_ids_to_tokens(t) for t in adapter._token_marks["moe_mm_token_type_ids"]}
    assert marked == {"<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>"}


def test_a_template_placeholder_other_than_the_image_token_is_found(tmp_path):
    adapter = build_adapter(ModelConfig(family="auto", path=qianfan_ocr(tmp_path)))
    assert adapter.image_token == "<image>" and adapter.processor.image_token == "<IMG_CONTEXT>"


def test_a_processor_without_a_template_of_its_own_is_checked_with_the_loaded_one(tmp_path):
    # its own call appends the separator to every text: refused by name, not with transformers' bare error
    with pytest.raises(TemplateNotPrefixStableError, match="appends '<reserved08706>' to every text"):
        build_adapter(ModelConfig(family="auto", path=chameleon(tmp_path)))


def test_a_text_model_listed_as_image_text_to_text_is_refused(tmp_path):
    with pytest.raises(UnsupportedProcessorError, match=r"Mistral4ForCausalLM.forward takes no \['pixel_values'"):
        build_adapter(ModelConfig(family="auto", path=mistral4(tmp_path)))
