"""LLaVA-1.5 adapter: Vicuna v1 rendering, exact labels, tiny model, ZeRO-3 dummy loss, save/reload."""

import os

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.collator import MultiImageCollator, model_inputs
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import encode_example
from mmtune.models.base import IGNORE_INDEX, ImageChunk, TokenChunk
from mmtune.models.config import ModelConfig
from mmtune.models.llava import VICUNA_V1_SYSTEM, LlavaAdapter
from mmtune.models.registry import build_adapter


@pytest.fixture(scope="module")
def model(adapter):
    return adapter.load_model()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("img")
    paths = []
    for k, (size, colour) in enumerate([((80, 60), (255, 0, 0)), ((40, 90), (0, 200, 0)), ((56, 56), (0, 0, 255))]):
        path = root / f"{k}.png"
        PILImage.new("RGB", size, colour).save(path)
        paths.append(str(path))
    return paths


def _dialogue(images):
    return Dialogue(
        "d0",
        "test",
        (
            Turn("user", ("Image1: ", Image(images[0]), ". Image2: ", Image(images[1]), ". Compare the two images.")),
            Turn("assistant", ("The first image is red, the second image is green.",)),
            Turn("user", ("What shape is shown in Image2?",)),
            Turn("assistant", ("A square.\nYes",)),
            Turn("user", (Image(images[2]), "\nDescribe the image.")),
            Turn("assistant", ("blue",)),
        ),
    )


def _messages(dialogue):
    out = []
    for turn in dialogue.turns:
        content = [{"type": "image"} if isinstance(s, Image) else {"type": "text", "text": s} for s in turn.segments]
        out.append({"role": turn.role, "content": content})
    return out


def _spans(ids, labels):
    spans, current = [], []
    for i, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


def test_tiny_config_is_small_and_counts_image_tokens(adapter, model):
    assert adapter.num_image_tokens == 16  # 56 px / 14 px patches, CLS dropped
    assert adapter.image_token_count(Image("/does/not/exist.jpg")) == 16  # no file access
    text = model.config.text_config
    assert text.num_hidden_layers == 2 and text.hidden_size <= 64
    assert model.config.vision_config.num_hidden_layers == 2 and model.config.vision_config.hidden_size <= 64
    assert adapter.text_config(model.config) is model.config.text_config
    assert adapter.tokenizer.convert_ids_to_tokens(adapter.image_token_id) == "<image>"


def test_ids_equal_tokenized_chat_template(adapter, images):
    """Chunk-wise encoding gives exactly the ids of the rendered Vicuna v1 prompt."""
    dialogue = _dialogue(images)
    example = encode_example(adapter, dialogue, max_length=None)
    rendered = adapter.tokenizer.apply_chat_template(_messages(dialogue), tokenize=False)
    assert rendered.startswith("<s>" + VICUNA_V1_SYSTEM + " USER: Image1: <image>. Image2: <image>. Compare")
    assert " ASSISTANT: A square.\nYes</s>USER: <image>\nDescribe the image. ASSISTANT: blue</s>" in rendered
    full = adapter.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    collapsed = []
    for token in example.input_ids:  # one <image> per image run
        if token == adapter.image_token_id and collapsed and collapsed[-1] == token:
            continue
        collapsed.append(token)
    assert collapsed == full


def test_labelled_spans_decode_to_assistant_texts(adapter, images):
    dialogue = _dialogue(images)
    example = encode_example(adapter, dialogue, max_length=None)
    spans = _spans(example.input_ids, example.labels)
    answers = [t.text for t in dialogue.turns if t.role == "assistant"]
    assert [adapter.tokenizer.decode(s) for s in spans] == [" " + a + "</s>" for a in answers]
    last = encode_example(adapter, dialogue, max_length=None, train_on="last_assistant")
    assert [adapter.tokenizer.decode(s) for s in _spans(last.input_ids, last.labels)] == [" blue</s>"]
    assert last.input_ids == example.input_ids


def test_image_runs_follow_placeholders(adapter, images):
    encoded = adapter.encode_dialogue(_dialogue(images))
    kinds = [type(c).__name__ for c in encoded.turns[0].chunks]
    assert kinds == ["TokenChunk", "TokenChunk", "ImageChunk", "TokenChunk", "ImageChunk", "TokenChunk"]
    image_chunks = [c for t in encoded.turns for c in t.chunks if isinstance(c, ImageChunk)]
    assert [c.image.path for c in image_chunks] == images
    assert all(c.num_tokens == 16 for c in image_chunks)
    assert encoded.prefix[0] == TokenChunk((adapter.tokenizer.bos_token_id,))


def test_system_prompt_and_generation_prompt(adapter, images):
    dialogue = Dialogue("g", "t", (Turn("user", ("Hi",)),))
    encoded = adapter.encode_dialogue(dialogue, system_prompt="", add_generation_prompt=True)
    ids = [i for c in encoded.prefix + encoded.turns[0].chunks + encoded.suffix for i in c.ids]
    # the official prompt is "{system} USER: ...", so an empty system prompt leaves the space
    assert adapter.tokenizer.decode(ids) == "<s> USER: Hi ASSISTANT:"
    with_system = Dialogue("s", "t", (Turn("system", ("Be brief.",)), Turn("user", ("Hi",)), Turn("assistant", ("ok",))))
    example = encode_example(adapter, with_system, max_length=None)
    assert adapter.tokenizer.decode(example.input_ids) == "<s>Be brief. USER: Hi ASSISTANT: ok</s>"
    with pytest.raises(ValueError, match="end with a user turn"):
        adapter.encode_dialogue(with_system, add_generation_prompt=True)


def test_module_groups_partition_parameters(adapter, model):
    groups = adapter.module_groups(model)
    ids = [id(p) for part in (groups.vision, groups.projector, groups.language_model) for m in part for p in m.parameters()]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))


def test_preprocess_pads_to_square_like_the_image_processor(adapter, images):
    pixels = adapter.preprocess_images(images)
    assert pixels.shape == (3, 3, 56, 56)
    reference = adapter.image_processor(
        images=[PILImage.open(p).convert("RGB") for p in images], return_tensors="pt"
    )["pixel_values"]
    torch.testing.assert_close(pixels, reference, atol=1e-5, rtol=0)
    # the padding of the 80x60 image is the CLIP mean colour, i.e. ~0 after normalisation
    assert pixels[0, :, 0, :].abs().max() < 0.02


def test_text_only_batch_gives_zero_not_none_vision_grads(adapter, model, images):
    collate = MultiImageCollator(adapter.tokenizer.pad_token_id)
    text_only = Dialogue("t", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Hello",))))
    batch = collate([encode_example(adapter, text_only, max_length=None)])
    assert batch["pixel_values"] is None
    model.zero_grad(set_to_none=True)
    loss = model(**model_inputs(batch)).loss + adapter.vision_dummy_loss(model)
    loss.backward()
    text_grads = {n: p.grad for n, p in model.named_parameters()}
    # the same parameters as a batch with a real image reaches
    model.zero_grad(set_to_none=True)
    example = encode_example(adapter, _dialogue(images), max_length=None)
    image_batch = MultiImageCollator(adapter.tokenizer.pad_token_id)([
        example.__class__(**{**example.__dict__, "pixel_values": adapter.preprocess_images([r.path for r in example.images])})
    ])
    model(**model_inputs(image_batch)).loss.backward()
    used = {n for n, p in model.named_parameters() if p.grad is not None}
    vision_used = {n for n in used if "vision_tower" in n or "multi_modal_projector" in n}
    assert any("multi_modal_projector" in n for n in vision_used) and any("vision_tower" in n for n in vision_used)
    for name in vision_used:
        assert text_grads[name] is not None, name
        assert torch.count_nonzero(text_grads[name]) == 0, name
    model.zero_grad(set_to_none=True)


def test_save_and_reload_roundtrip(adapter, model, images, tmp_path):
    model.save_pretrained(tmp_path)
    adapter.save_pretrained(tmp_path)
    assert os.path.exists(tmp_path / "processor_config.json")
    reloaded = build_adapter(ModelConfig(family="llava", path=str(tmp_path)))
    assert isinstance(reloaded, LlavaAdapter)
    dialogue = _dialogue(images)
    a = encode_example(adapter, dialogue, max_length=None)
    b = encode_example(reloaded, dialogue, max_length=None)
    assert a.input_ids == b.input_ids and a.labels == b.labels
    torch.testing.assert_close(reloaded.preprocess_images(images), adapter.preprocess_images(images))
    model2 = reloaded.load_model()
    batch = MultiImageCollator(adapter.tokenizer.pad_token_id, image_pipeline=None)([
        a.__class__(**{**a.__dict__, "pixel_values": adapter.preprocess_images([r.path for r in a.images])})
    ])
    with torch.no_grad():
        torch.testing.assert_close(model(**model_inputs(batch)).logits, model2(**model_inputs(batch)).logits)


def test_bad_configs_raise_clear_errors():
    with pytest.raises(ValueError, match="image_aspect_ratio"):
        LlavaAdapter(ModelConfig(family="llava", llava={"image_aspect_ratio": "anyres"}))
    adapter = build_adapter(ModelConfig(family="llava"))
    bad = Dialogue("bad", "t", (Turn("user", ("q",)), Turn("assistant", ("a", Image("/x.png")))))
    with pytest.raises(ValueError, match="'bad', turn 1"):
        adapter.encode_dialogue(bad)


def test_model_yamls_load_into_model_config():
    from pathlib import Path

    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[2] / "configs" / "model"
    schema = OmegaConf.structured(ModelConfig())
    configs = {p.stem: OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.load(p))) for p in root.glob("*.yaml")}
    assert {"llava_tiny", "llava_100m", "llava_1_5_7b", "llava_1_5_13b", "auto_example"} <= set(configs)
    tiny = build_adapter(configs["llava_tiny"])
    assert tiny.num_image_tokens == 16 and tiny.model_config.text_config.hidden_size == 64
    big = build_adapter(configs["llava_100m"])
    assert big.num_image_tokens == 576
    with torch.device("meta"):
        from transformers import LlavaForConditionalGeneration

        params = sum(p.numel() for p in LlavaForConditionalGeneration(big.model_config).parameters())
    assert 80e6 < params < 130e6


def _save_llava_dir(path, backend, *, chat_template=None):
    """A LLaVA checkpoint directory (tiny random config) around a ``tokenizers`` backend."""
    from transformers import LlavaConfig, LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from mmtune.models.llava import TINY_ARCHITECTURE

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    arch = {**TINY_ARCHITECTURE, "text_config": {**TINY_ARCHITECTURE["text_config"], "vocab_size": len(tokenizer)}}
    LlavaConfig(**arch, image_token_id=3).save_pretrained(path)
    LlavaProcessor(
        image_processor=LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
        tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default", chat_template=chat_template,
    ).save_pretrained(path)


def test_sentencepiece_style_tokenizer_checkpoint(tmp_path, images, caplog):
    """A checkpoint whose tokenizer puts a word-start marker before every piece (as Llama's
    does): the separator space is not doubled and labels still decode to the answers. It is
    no SentencePiece conversion (no byte pieces), so the adapter says it cannot be exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mmtune.models.llava import VICUNA_V1_CHAT_TEMPLATE
    from mmtune.testing.tokenizers import _BASE_CORPUS

    backend = Tokenizer(models.BPE(byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!:;'\"()\n\u2581")
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", "<image>", "<pad>"],
        initial_alphabet=alphabet, show_progress=False,
    )
    backend.train_from_iterator([_BASE_CORPUS] * 4, trainer=trainer)
    _save_llava_dir(tmp_path, backend, chat_template=VICUNA_V1_CHAT_TEMPLATE)

    with caplog.at_level("WARNING", logger="mmtune.models.llava"):
        adapter = build_adapter(ModelConfig(family="llava", path=str(tmp_path)))
    assert adapter._dummy_prefix and adapter._sp is None
    assert "whose ids can differ from LLaVA-1.5's SentencePiece encoding" in caplog.text
    dialogue = _dialogue(images)
    example = encode_example(adapter, dialogue, max_length=None)
    answers = [t.text for t in dialogue.turns if t.role == "assistant"]
    assert [adapter.tokenizer.decode(s) for s in _spans(example.input_ids, example.labels)] == [a + "</s>" for a in answers]
    tokens = adapter.tokenizer.convert_ids_to_tokens(example.input_ids)
    # the template's separator spaces are the markers of the next word; a lone marker only
    # where a chunk of the official encoding ends in a space (before an image)
    for k, token in enumerate(tokens):
        if token == "\u2581ASSISTANT:":
            assert tokens[k - 1] != "\u2581" and tokens[k + 1].startswith("\u2581") and tokens[k + 1] != "\u2581"
        if token == "\u2581":
            assert example.input_ids[k + 1] == adapter.image_token_id
    # the same words in the same order as the template renders (SentencePiece adds a word
    # marker after special tokens and at piece starts, as LLaVA's own chunk-wise tokenization did)
    text = adapter.tokenizer.decode([t for t in example.input_ids if t != adapter.image_token_id])
    rendered = adapter.tokenizer.apply_chat_template(_messages(dialogue), tokenize=False).replace("<image>", "")
    assert text.split() == rendered.replace("<s>", "<s> ").replace("</s>", "</s> ").split()


@pytest.mark.parametrize("image_size", [56, 336])
def test_uint8_pixels_equal_the_image_processor_bit_for_bit(tmp_path, image_size):
    import numpy as np

    adapter = build_adapter(ModelConfig(family="llava", llava={"image_size": image_size}))
    for k, size in enumerate([(800, 600), (801, 599), (200, 57), (60, 80), (333, 500), (64, 64)]):
        path = tmp_path / f"n{k}.png"
        PILImage.effect_noise(size, 70).convert("RGB").save(path)
        ours = adapter.load_uint8(str(path))
        reference = adapter.image_processor(
            images=[PILImage.open(path).convert("RGB")], do_rescale=False, do_normalize=False
        )["pixel_values"][0]
        assert np.array_equal(ours, np.asarray(reference, dtype=np.uint8)), size


def test_tokenizer_that_cannot_spell_the_template_fails_at_start_up(tmp_path):
    """A tokenizer mapping USER / ASSISTANT to <unk> would train on invisible role names."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": 3, "<pad>": 4, "USER": 5, "hello": 6}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    _save_llava_dir(tmp_path, backend)
    with pytest.raises(ValueError, match=r"maps the chat template's words \['ASSISTANT'\] to the unknown token"):
        build_adapter(ModelConfig(family="llava", path=str(tmp_path)))


def test_dialogues_equal_the_llava_processor(adapter, tmp_path):
    """Generated multi-image, multi-turn dialogues: the adapter's ids and generation prompts equal
    transformers' ``LlavaProcessor(text=apply_chat_template(messages), images=...)`` (the adapter's
    own processor: Vicuna v1 template, CLIP image processor padding to a square), its pixel_values
    within 1e-6 (normalised per batch from the cached uint8 image, a different order of float ops)."""
    import random

    import numpy as np
    from transformers.image_utils import load_image

    from mmtune.data.encoding import flatten

    rng = random.Random(3)
    noise = np.random.default_rng(3)
    sizes = [(80, 60), (40, 90), (56, 56), (200, 30), (17, 120), (333, 250)]
    paths = []
    for k, (width, height) in enumerate(sizes):
        path = str(tmp_path / f"n{k}.{'jpg' if k % 2 else 'png'}")
        PILImage.fromarray(noise.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    texts = ["What is it?", "Compare {img} and {img}.", "{img}\nDescribe.", "  spaced  ", "{img}{img} both?", "ok"]
    processor = adapter.processor
    identical = {"input_ids": 0, "pixel_values": 0, "generation_prompt": 0}
    bit_identical, largest = 0, 0.0  # normalised from the uint8 cache per batch: float rounding may differ
    n_dialogues = 30
    for n in range(n_dialogues):
        turns, used = [], iter(paths * 50)
        for _ in range(rng.randint(1, 3)):
            segments = []
            for j, piece in enumerate(rng.choice(texts).split("{img}")):
                segments += ([Image(next(used))] if j else []) + ([piece] if piece else [])
            turns += [Turn("user", tuple(segments)), Turn("assistant", (rng.choice(["Yes.", "A square.\nYes"]),))]
        dialogue = Dialogue(f"d{n}", "test", tuple(turns))
        images = [i.path for t in dialogue.turns for i in t.images]
        example = encode_example(adapter, dialogue, max_length=None)
        text = processor.apply_chat_template(_messages(dialogue), tokenize=False)
        real = processor(text=[text], images=[load_image(p) for p in images] or None, return_tensors="pt",
                         add_special_tokens=False)  # the template renders <s>
        identical["input_ids"] += example.input_ids == real["input_ids"][0].tolist()
        if images:
            ours = adapter.image_inputs(images)["pixel_values"]
            identical["pixel_values"] += bool(torch.allclose(ours, real["pixel_values"], atol=1e-6, rtol=0))
            bit_identical += torch.equal(ours, real["pixel_values"])
            largest = max(largest, float((ours - real["pixel_values"]).abs().max()))
        else:
            identical["pixel_values"] += "pixel_values" not in real
            bit_identical += "pixel_values" not in real
        prompt = Dialogue(dialogue.id, "test", dialogue.turns[:-1])
        prompt_ids = flatten(adapter.encode_dialogue(prompt, add_generation_prompt=True), adapter.image_token_id)[0]
        prompt_text = processor.apply_chat_template(_messages(prompt), tokenize=False, add_generation_prompt=True)
        real_prompt = processor(text=[prompt_text], images=[load_image(p) for p in images] or None,
                                add_special_tokens=False)["input_ids"][0]  # fmt: skip
        identical["generation_prompt"] += prompt_ids == list(real_prompt)
    print(f"llava: identical / {n_dialogues} dialogues: {identical} (pixel_values within 1e-6; bit-identical "
          f"{bit_identical}, largest difference {largest:.2e})")
    assert identical == {key: n_dialogues for key in identical}
