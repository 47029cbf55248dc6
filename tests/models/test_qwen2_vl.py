"""qwen2_vl adapter: template and system prompts, chunks, truncation, bad images, pixel bounds,
M-RoPE positions, the tiny models (module groups, ZeRO-3 dummy loss, LoRA targets), save/reload.

Token / pixel / position fidelity against transformers on many generated dialogues is in
``test_qwen2_vl_fidelity.py``.
"""

import json
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import encode_example, flatten
from mmtune.data.images import CorruptImageError
from mmtune.models.base import IGNORE_INDEX, ImageChunk, TokenChunk
from mmtune.models.config import ModelConfig
from mmtune.models.qwen2_vl import (
    CHAT_TEMPLATES,
    MODEL_TYPES,
    Qwen2VLAdapter,
    TemplateMismatchError,
    UnsupportedImageError,
    model_classes,
)
from mmtune.models.registry import build_adapter
from mmtune.testing.qwen2_vl import save_tiny_checkpoint


def _adapter(model_type, **kwargs):
    return build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": model_type}, **kwargs))


@pytest.fixture(scope="module")
def adapters():
    return {t: _adapter(t) for t in MODEL_TYPES}


@pytest.fixture(scope="module")
def models(adapters):
    return {t: a.load_model() for t, a in adapters.items()}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("qimg")
    paths = []
    for k, (size, colour) in enumerate([((80, 60), (255, 0, 0)), ((40, 120), (0, 200, 0)), ((30, 30), (0, 0, 255))]):
        path = root / f"{k}.png"
        PILImage.new("RGB", size, colour).save(path)
        paths.append(str(path))
    return paths


def _dialogue(images, system=None):
    turns = [Turn("system", (system,))] if system is not None else []
    return Dialogue("q0", "test", tuple(turns) + (
        Turn("user", ("Image1: ", Image(images[0]), "\nImage2: ", Image(images[1]), " Compare the two images.")),
        Turn("assistant", ("The first image is red, the second image is green.",)),
        Turn("user", ("What is shown in Image2?",)),
        Turn("assistant", ("A square.\nYes",)),
        Turn("user", (Image(images[2]), "\nDescribe the image.")),
        Turn("assistant", ("blue",)),
    ))  # fmt: skip


def _messages(dialogue, system_prompt=None):
    out = []
    turns = list(dialogue.turns)
    if system_prompt is not None and turns[0].role != "system":
        out.append({"role": "system", "content": system_prompt})
    for turn in turns:
        if turn.role == "user":
            parts = []
            for s in turn.segments:
                if isinstance(s, Image):
                    parts.append({"type": "image"})
                elif s.strip():
                    parts.append({"type": "text", "text": s.strip()})
            out.append({"role": "user", "content": parts})
        else:
            out.append({"role": turn.role, "content": turn.text})
    return out


def _collapsed(adapter, ids):
    """Each run of image tokens -> one <|image_pad|>, as the chat template renders an image."""
    out = []
    for token in ids:
        if token == adapter.image_token_id and out and out[-1] == token:
            continue
        out.append(token)
    return out


def _template_ids(adapter, messages, add_generation_prompt=False):
    text = adapter.tokenizer.apply_chat_template(
        messages, chat_template=adapter.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return adapter.tokenizer(text)["input_ids"], text


# -- tiny models and tokenizers ------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tiny_models_are_small_and_use_their_own_classes(model_type, adapters, models):
    adapter, model = adapters[model_type], models[model_type]
    generation_class = model_classes(model_type)
    assert type(model) is generation_class and model.config.model_type == model_type
    text = adapter.text_config(model.config)
    assert text is model.config.text_config and text.num_hidden_layers == 2 and text.hidden_size <= 64
    assert model.config.vision_config.depth == 2
    tok = adapter.tokenizer
    assert tok.convert_ids_to_tokens(adapter.image_token_id) == "<|image_pad|>"
    assert tok.convert_ids_to_tokens(adapter.stop_token_ids) == ["<|im_end|>", "<|endoftext|>"]
    assert tok.convert_ids_to_tokens(tok("assistant user system")["input_ids"]) == ["assistant", "Ġuser", "Ġsystem"]
    assert adapter.position_id_rows == 3


def test_dispatch_is_by_config_model_type_not_by_name(tmp_path):
    # a Qwen2.5-VL checkpoint in a directory whose name says Qwen3-VL
    directory = save_tiny_checkpoint(str(tmp_path / "Qwen3-VL-8B"), "qwen2_5_vl")
    adapter = build_adapter(ModelConfig(family="qwen2_vl", path=directory))
    assert adapter.model_type == "qwen2_5_vl"
    assert type(adapter.load_model()).__name__ == "Qwen2_5_VLForConditionalGeneration"
    other = tmp_path / "other"
    other.mkdir()
    with open(other / "config.json", "w") as handle:
        json.dump({"model_type": "llava", "text_config": {"model_type": "llama"}}, handle)
    with pytest.raises(ValueError, match="'llava' checkpoint.*qwen2_vl family covers"):
        build_adapter(ModelConfig(family="qwen2_vl", path=str(other)))
    with pytest.raises(ValueError, match="architecture.model_type='qwen4_vl'"):
        _adapter("qwen4_vl")


# -- template, system prompt, chunks --------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_system_prompt_handling_follows_the_template(model_type, adapters, images):
    adapter = adapters[model_type]
    dialogue = _dialogue(images)
    default = "You are a helpful assistant." if model_type != "qwen3_vl" else None
    assert adapter.renderer.default_system == default
    for system_prompt in (None, "Answer briefly.", ""):
        example = encode_example(adapter, dialogue, max_length=None, system_prompt=system_prompt)
        want, text = _template_ids(adapter, _messages(dialogue, system_prompt))
        assert _collapsed(adapter, example.input_ids) == want
        if system_prompt is None:
            assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")\
                if default else text.startswith("<|im_start|>user\nImage1:<|vision_start|><|image_pad|>")  # fmt: skip
    # a system turn of the dialogue wins over system_prompt
    with_system = _dialogue(images, system="Be kind.")
    example = encode_example(adapter, with_system, max_length=None, system_prompt="ignored")
    want, text = _template_ids(adapter, _messages(with_system))
    assert _collapsed(adapter, example.input_ids) == want and text.startswith("<|im_start|>system\nBe kind.<|im_end|>")


def test_chunks_images_and_labels(adapters, images):
    adapter = adapters["qwen2_vl"]
    tok = adapter.tokenizer
    encoded = adapter.encode_dialogue(_dialogue(images))
    first = encoded.turns[0].chunks
    kinds = [type(c).__name__ for c in first]
    assert kinds == ["TokenChunk"] * 3 + ["ImageChunk"] + ["TokenChunk"] * 3 + ["ImageChunk"] + ["TokenChunk"] * 4
    # <|vision_start|> + ImageChunk(the pad tokens only) + <|vision_end|>
    assert tok.convert_ids_to_tokens(first[2].ids) == ["<|vision_start|>"]
    assert tok.convert_ids_to_tokens(first[4].ids) == ["<|vision_end|>"]
    image_chunks = [c for t in encoded.turns for c in t.chunks if isinstance(c, ImageChunk)]
    assert [c.image.path for c in image_chunks] == images
    # 80x60 -> 84x56 px -> 3x2 merged tokens; 40x120 -> 28x112 -> 1x4; 30x30 -> 56x56 (up to min_pixels) -> 2x2
    assert [c.num_tokens for c in image_chunks] == [6, 4, 4]
    assert encoded.prefix[0] == TokenChunk((tok.convert_tokens_to_ids("<|im_start|>"),))
    example = encode_example(adapter, _dialogue(images), max_length=None)
    spans, current = [], []
    for label in example.labels:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            spans, current = spans + [current], []
    spans += [current] if current else []
    answers = ["The first image is red, the second image is green.", "A square.\nYes", "blue"]
    assert [tok.decode(s) for s in spans] == [a + "<|im_end|>\n" for a in answers]
    last = encode_example(adapter, _dialogue(images), max_length=None, train_on="last_assistant")
    assert last.input_ids == example.input_ids
    assert tok.decode([label for label in last.labels if label != IGNORE_INDEX]) == "blue<|im_end|>\n"


def test_generation_prompt(adapters, images):
    adapter = adapters["qwen3_vl"]
    dialogue = Dialogue("g", "t", (Turn("user", (Image(images[2]), "Hi")),))
    encoded = adapter.encode_dialogue(dialogue, add_generation_prompt=True)
    ids, labels, refs = flatten(encoded, adapter.image_token_id)
    want, text = _template_ids(adapter, _messages(dialogue), add_generation_prompt=True)
    assert _collapsed(adapter, ids) == want and text.endswith("<|im_start|>assistant\n")
    assert all(label == IGNORE_INDEX for label in labels) and [r.path for r in refs] == [images[2]]
    with pytest.raises(ValueError, match="end with a user turn"):
        adapter.encode_dialogue(_dialogue(images), add_generation_prompt=True)


def test_truncation_keeps_whole_turns_and_the_system_block(adapters, images):
    adapter = adapters["qwen2_5_vl"]
    dialogue = _dialogue(images, system="S.")
    full = encode_example(adapter, dialogue, max_length=None)
    two = Dialogue(dialogue.id, dialogue.source, dialogue.turns[:3])  # system + first exchange
    want = encode_example(adapter, two, max_length=None)
    truncated = encode_example(adapter, dialogue, max_length=len(want.input_ids) + 3)
    assert truncated.input_ids == want.input_ids and truncated.labels == want.labels
    assert truncated.dropped_turns == 4 and [r.path for r in truncated.images] == images[:2]
    assert len(full.input_ids) > len(truncated.input_ids)
    assert encode_example(adapter, dialogue, max_length=10) is None  # the first exchange alone is too long


def test_control_token_strings_in_text_stay_text(adapters):
    adapter = adapters["qwen2_vl"]
    tok = adapter.tokenizer
    dialogue = Dialogue("c", "t", (Turn("user", ("say <|im_end|> and <|image_pad|>",)),
                                   Turn("assistant", ("<|im_start|>assistant",))))  # fmt: skip
    example = encode_example(adapter, dialogue, max_length=None)
    assert adapter.image_token_id not in example.input_ids
    specials = [t for t in tok.convert_ids_to_tokens(example.input_ids) if t.startswith("<|")]
    assert specials == ["<|im_start|>", "<|im_end|>"] * 3  # system, user, assistant: the template's own only
    assert "say <|im_end|> and <|image_pad|>" in tok.decode(example.input_ids)


def test_assistant_images_and_misplaced_roles_are_refused(adapters, images):
    adapter = adapters["qwen2_vl"]
    bad = Dialogue("bad", "t", (Turn("user", ("q",)), Turn("assistant", ("a", Image(images[0])))))
    with pytest.raises(ValueError, match="'bad', turn 1: an assistant turn holds 1 image"):
        adapter.encode_dialogue(bad)
    image_system = Dialogue("sys", "t", (Turn("system", ("s", Image(images[0]))), Turn("user", ("q",))))
    with pytest.raises(ValueError, match="'sys', turn 0: the system turn holds 1 image"):
        adapter.encode_dialogue(image_system)
    late_system = Dialogue("late", "t", (Turn("user", ("q",)), Turn("system", ("s",))))
    with pytest.raises(ValueError, match="'late', turn 1: role 'system'"):
        adapter.encode_dialogue(late_system)


# -- images ---------------------------------------------------------------------------------------


def test_refused_and_unreadable_images_are_named(adapters, tmp_path):
    adapter = adapters["qwen2_vl"]
    wide = tmp_path / "wide.png"
    PILImage.new("RGB", (201, 1)).save(wide)
    dialogue = Dialogue("rec-7", "t", (Turn("user", ("a",)), Turn("assistant", ("b",)),
                                       Turn("user", (Image(str(wide)), "c")), Turn("assistant", ("d",))))  # fmt: skip
    with pytest.raises(UnsupportedImageError, match=r"wide.png' \(dialogue 'rec-7', turn 2 \(question\)\).*201 x 1 px.*200") as info:
        encode_example(adapter, dialogue, max_length=None)
    assert isinstance(info.value, CorruptImageError) and info.value.turn == 2
    with pytest.raises(UnsupportedImageError, match="rec-7"):
        adapter.measure_many([dialogue])
    missing = Dialogue("rec-8", "t", (Turn("user", (Image(str(tmp_path / "gone.png")),)), Turn("assistant", ("b",))))
    with pytest.raises(CorruptImageError, match=r"gone.png' \(dialogue 'rec-8', turn 1 \(question\)\)"):
        adapter.encode_dialogue(missing)
    ok = tmp_path / "ok.png"
    PILImage.new("RGB", (200, 1)).save(ok)  # exactly the largest ratio the processor accepts
    assert adapter.image_token_count(Image(str(ok))) > 0


@pytest.mark.filterwarnings("ignore:Palette images with Transparency")  # PIL on the P-mode file, both paths
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_uint8_path_equals_the_processor_on_every_image_mode(model_type, adapters, tmp_path):
    from transformers.image_utils import load_image

    adapter = adapters[model_type]
    rng = np.random.default_rng(1)
    paths = []
    for k, mode in enumerate(["RGB", "RGBA", "L", "LA", "P", "CMYK", "I;16"]):
        pixels = rng.integers(0, 256, (37 + 5 * k, 61 - 3 * k, 4), dtype=np.uint8)
        image = PILImage.fromarray(pixels, "RGBA")
        image = image.convert("P", palette=PILImage.Palette.ADAPTIVE) if mode == "P" else image.convert(mode)
        path = str(tmp_path / f"{k}.{'jpg' if mode == 'CMYK' else 'png'}")
        image.save(path)
        paths.append(path)
    want = adapter.image_processor(images=[load_image(p) for p in paths], return_tensors="pt")
    raw = [adapter.load_uint8(p) for p in paths]
    assert all(r.dtype == np.uint8 and r.shape[0] == 3 for r in raw)
    for got in (adapter.image_inputs(paths), adapter.image_inputs_uint8([torch.from_numpy(r) for r in raw])):
        assert torch.equal(got["pixel_values"], want["pixel_values"])
        assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    empty = adapter.image_inputs([])
    assert empty["pixel_values"].shape == (0, want["pixel_values"].shape[1]) and empty["image_grid_thw"].shape == (0, 3)
    with pytest.raises(NotImplementedError, match="image_inputs"):
        adapter.preprocess_images(paths)


def test_pixel_bounds_change_token_counts_as_the_processor(tmp_path, images):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    big = tmp_path / "big.png"
    PILImage.new("RGB", (900, 500), (9, 9, 9)).save(big)
    directory = save_tiny_checkpoint(str(tmp_path / "ckpt"), "qwen2_vl", weights=False)
    default = build_adapter(ModelConfig(family="qwen2_vl", path=directory))
    small = build_adapter(ModelConfig(family="qwen2_vl", path=directory,
                                        qwen2_vl={"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 8}))
    large = build_adapter(ModelConfig(family="qwen2_vl", path=directory, qwen2_vl={"max_pixels": 28 * 28 * 300}))
    for adapter in (default, small, large):
        p = adapter.image_processor
        h, w = smart_resize(500, 900, 28, p.size.shortest_edge, p.size.longest_edge)
        assert adapter.image_token_count(Image(str(big))) == h * w // 28**2
        assert adapter.image_inputs([str(big)])["image_grid_thw"].tolist() == [[1, h // 14, w // 14]]
    counts = [a.image_token_count(Image(str(big))) for a in (small, default, large)]
    assert counts[0] <= 8 < counts[1] <= 64 < counts[2] <= 300
    assert len({a.fingerprint() for a in (default, small, large)}) == 3
    # a saved checkpoint keeps the bounds it was trained with
    small.save_pretrained(str(tmp_path / "saved"))
    default.model_config.save_pretrained(str(tmp_path / "saved"))
    reloaded = build_adapter(ModelConfig(family="qwen2_vl", path=str(tmp_path / "saved")))
    assert reloaded.image_token_count(Image(str(big))) == counts[0]


def test_pixel_bounds_are_validated_and_refused_for_other_families():
    with pytest.raises(ValueError, match="model.qwen2_vl.min_pixels=784 is not read by model.family='llava'"):
        build_adapter(ModelConfig(family="llava", qwen2_vl={"min_pixels": 784}))
    with pytest.raises(ValueError, match="model.min_pixels=784 is not read by model.family='llava'"):
        build_adapter(ModelConfig(family="llava", min_pixels=784))  # the deprecated flat spelling
    with pytest.raises(ValueError) as info:
        ModelConfig(family="qwen2_vl", qwen2_vl={"min_pixels": 0, "max_pixels": -5}).validate()
    assert "model.qwen2_vl.min_pixels=0 must be > 0" in str(info.value)
    assert "model.qwen2_vl.max_pixels=-5 must be > 0" in str(info.value)
    with pytest.raises(ValueError, match="min_pixels=5000 is above model.qwen2_vl.max_pixels=4000"):
        ModelConfig(family="qwen2_vl", qwen2_vl={"min_pixels": 5000, "max_pixels": 4000}).validate()


# -- checkpoints and templates ----------------------------------------------------------------------


def test_checkpoint_without_chat_template_is_refused(tmp_path):
    directory = save_tiny_checkpoint(str(tmp_path / "none"), "qwen2_vl", weights=False, template="none")
    with pytest.raises(ValueError, match="has no chat template.*copy chat_template.json from the base model"):
        build_adapter(ModelConfig(family="qwen2_vl", path=directory))
    # a template in tokenizer_config.json is read as well
    directory = save_tiny_checkpoint(str(tmp_path / "tok"), "qwen3_vl", weights=False, template="tokenizer")
    assert build_adapter(ModelConfig(family="qwen2_vl", path=directory)).renderer.default_system is None


def test_a_template_with_another_layout_is_refused(tmp_path):
    directory = save_tiny_checkpoint(str(tmp_path / "other"), "qwen2_vl", weights=False)
    other = CHAT_TEMPLATES["qwen2_vl"].replace("<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>\n")
    with open(os.path.join(directory, "chat_template.json"), "w") as handle:
        json.dump({"chat_template": other}, handle)
    with pytest.raises(TemplateMismatchError, match="probe probe-3.*first difference"):
        build_adapter(ModelConfig(family="qwen2_vl", path=directory))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_save_and_reload_roundtrip(model_type, adapters, models, images, tmp_path):
    adapter, model = adapters[model_type], models[model_type]
    model.save_pretrained(tmp_path)
    adapter.save_pretrained(str(tmp_path))
    reloaded = build_adapter(ModelConfig(family="qwen2_vl", path=str(tmp_path)))
    assert isinstance(reloaded, Qwen2VLAdapter) and reloaded.model_type == model_type
    a = encode_example(adapter, _dialogue(images), max_length=None)
    b = encode_example(reloaded, _dialogue(images), max_length=None)
    assert a.input_ids == b.input_ids and a.labels == b.labels
    inputs = adapter.image_inputs(images)
    assert torch.equal(inputs["pixel_values"], reloaded.image_inputs(images)["pixel_values"])
    model2 = reloaded.load_model()
    ids = torch.tensor([a.input_ids])
    positions = adapter.position_ids(ids[0], inputs)[:, None]
    with torch.no_grad():
        one = model(input_ids=ids, position_ids=positions, use_cache=False, **inputs).logits
        two = model2(input_ids=ids, position_ids=positions, use_cache=False, **inputs).logits
    torch.testing.assert_close(one, two, rtol=0, atol=0)


# -- positions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_positions_equal_the_models_own_and_packing_needs_the_text_row(model_type, adapters, models, images):
    """Our per-sample M-RoPE positions give the logits of the model computing them itself; two
    samples packed in one row match each run alone only with the 4-row layout (text row first),
    which is what transformers reads packed-sample boundaries from."""
    adapter, model = adapters[model_type], models[model_type]
    first = encode_example(adapter, _dialogue(images), max_length=None)
    second = encode_example(adapter, Dialogue("s", "t", (Turn("user", (Image(images[2]), "Hi")),
                                                        Turn("assistant", ("Yes.",)))), max_length=None)  # fmt: skip
    samples = []
    model.eval()
    with torch.no_grad():
        for example in (first, second):
            ids = torch.tensor([example.input_ids])
            inputs = adapter.image_inputs([r.path for r in example.images])
            positions = adapter.position_ids(ids[0], inputs)
            assert positions.shape == (3, ids.shape[1]) and positions.dtype == torch.long
            itself = model(input_ids=ids, mm_token_type_ids=(ids == adapter.image_token_id).int(), use_cache=False,
                           **inputs).logits  # fmt: skip
            ours = model(input_ids=ids, position_ids=positions[:, None], use_cache=False, **inputs).logits
            torch.testing.assert_close(ours, itself, rtol=0, atol=0)
            samples.append((ids, inputs, positions, ours[0]))
        ids = torch.cat([s[0] for s in samples], dim=1)
        inputs = {k: torch.cat([s[1][k] for s in samples]) for k in ("pixel_values", "image_grid_thw")}
        mrope = torch.cat([s[2] for s in samples], dim=1)[:, None]  # each sample restarts at 0
        text = torch.cat([torch.arange(s[0].shape[1]) for s in samples])[None, None]
        n = samples[0][0].shape[1]
        four = model(input_ids=ids, position_ids=torch.cat([text, mrope]), attention_mask=None, use_cache=False,
                     **inputs).logits[0]  # fmt: skip
        torch.testing.assert_close(four[:n], samples[0][3], rtol=0, atol=1e-5)
        torch.testing.assert_close(four[n:], samples[1][3], rtol=0, atol=1e-5)
        three = model(input_ids=ids, position_ids=mrope, attention_mask=None, use_cache=False, **inputs).logits[0]
        assert (three[n:] - samples[1][3]).abs().max() > 1e-3  # without the text row the samples see each other
    model.train()


def test_text_only_positions_and_mismatched_image_inputs(adapters, images):
    adapter = adapters["qwen2_vl"]
    text_only = encode_example(adapter, Dialogue("t", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Yo",)))),
                               max_length=None)  # fmt: skip
    ids = torch.tensor(text_only.input_ids)
    assert torch.equal(adapter.position_ids(ids, adapter.image_inputs([])), torch.arange(len(ids)).expand(3, -1))
    example = encode_example(adapter, _dialogue(images), max_length=None)
    ids = torch.tensor(example.input_ids)
    with pytest.raises(ValueError, match=r"3 image-token run\(s\) of lengths \[6, 4, 4\] but image_grid_thw has 2 image\(s\) of \[6, 4\]"):
        adapter.position_ids(ids, adapter.image_inputs(images[:2]))
    with pytest.raises(ValueError, match="one sample"):
        adapter.position_ids(ids[None], adapter.image_inputs(images))


def test_adapter_pickles_for_dataloader_workers(adapters, images):
    adapter = adapters["qwen3_vl"]
    example = encode_example(adapter, _dialogue(images), max_length=None)
    ids = torch.tensor(example.input_ids)
    before = adapter.position_ids(ids, adapter.image_inputs(images))  # builds the meta-device rope model
    clone = pickle.loads(pickle.dumps(adapter))
    assert encode_example(clone, _dialogue(images), max_length=None).input_ids == example.input_ids
    assert torch.equal(clone.position_ids(ids, clone.image_inputs(images)), before)


# -- model parts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_module_groups_partition_parameters_and_lora_stays_in_the_language_model(model_type, adapters, models):
    from mmtune.training.peft_setup import lora_target_names

    adapter, model = adapters[model_type], models[model_type]
    groups = adapter.module_groups(model)
    ids = [id(p) for part in (groups.vision, groups.projector, groups.language_model) for m in part for p in m.parameters()]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert groups.projector == [model.model.visual.merger]
    names = lora_target_names(model, groups, adapter.default_lora_targets)
    assert names and not any("visual" in n for n in names)
    assert {n.rsplit(".", 1)[-1] for n in names} == set(adapter.default_lora_targets)
    body, head = adapter.loss_modules(model)
    assert body is model.model and head is model.lm_head


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_text_only_batch_gives_zero_not_none_vision_grads(model_type, adapters, models, images):
    adapter, model = adapters[model_type], models[model_type]
    text_only = encode_example(adapter, Dialogue("t", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Hello",)))),
                               max_length=None)  # fmt: skip
    ids, labels = torch.tensor([text_only.input_ids]), torch.tensor([text_only.labels])
    model.zero_grad(set_to_none=True)
    dummy = adapter.vision_dummy_loss(model)
    assert dummy.item() == 0.0
    (model(input_ids=ids, labels=labels, use_cache=False).loss + dummy).backward()
    text_grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    example = encode_example(adapter, _dialogue(images), max_length=None)
    ids, labels = torch.tensor([example.input_ids]), torch.tensor([example.labels])
    inputs = adapter.image_inputs([r.path for r in example.images])
    positions = adapter.position_ids(ids[0], inputs)[:, None]
    model(input_ids=ids, labels=labels, position_ids=positions, use_cache=False, **inputs).loss.backward()
    used = {n for n, p in model.named_parameters() if p.grad is not None and "visual" in n}
    assert any("merger" in n for n in used) and any("blocks" in n for n in used)
    for name in used:
        assert text_grads[name] is not None, name
        assert torch.count_nonzero(text_grads[name]) == 0, name
    model.zero_grad(set_to_none=True)


def test_model_configs_build_and_validate():
    from omegaconf import OmegaConf

    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "model")
    for name in ("qwen2_vl_tiny", "qwen2_5_vl_7b", "qwen3_vl_8b"):
        config = ModelConfig(**OmegaConf.to_container(OmegaConf.load(os.path.join(root, name + ".yaml"))))
        config.validate()
        assert config.family == "qwen2_vl"
    tiny = build_adapter(ModelConfig(**OmegaConf.to_container(OmegaConf.load(os.path.join(root, "qwen2_vl_tiny.yaml")))))
    assert tiny.model_type == "qwen2_vl" and tiny.model_config.text_config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="model.image_size=448 is not read"):
        ModelConfig(family="qwen2_vl", image_size=448).validate()
    with pytest.raises(ValueError, match="model.llava.image_size=448 is not read by model.family='qwen2_vl'"):
        ModelConfig(family="qwen2_vl", llava={"image_size": 448}).validate()
