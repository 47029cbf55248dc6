"""The text a processor puts in place of an image, where its own ``__call__`` gives no
``text_replacement_offsets`` (Idefics2's, Mllama's): read off the one text it hands its tokenizer,
or the checkpoint is refused at start-up naming why (never a bare ``KeyError``)."""

import pytest
from PIL import Image as PILImage

from mmtune.models.auto import AutoAdapter, UnsupportedProcessorError
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from tests.support.auto_checkpoints import checkpoint

# a plain placeholder (InternVL), wrappers the processor requires around it (HunYuan-VL), a text the
# processor's call adds before everything (Janus's default system prompt)
KINDS = ["internvl", "hunyuan_vl", "janus"]
SIZES = [(50, 30), (24, 70), (64, 64), (130, 20)]


def _without_offsets(adapter: AutoAdapter) -> None:
    """The adapter's processor, as one whose ``__call__`` never returns the offsets."""
    base = type(adapter.processor)

    class NoOffsets(base):
        def __call__(self, *args, **kwargs):
            kwargs.pop("return_text_replacement_offsets", None)
            return base.__call__(self, *args, **kwargs)

    adapter.processor.__class__ = NoOffsets


@pytest.mark.parametrize("kind", KINDS)
def test_the_text_the_tokenizer_is_handed_gives_the_offsets_replacements(kind):
    adapter = build_adapter(ModelConfig(family="auto", path=checkpoint(kind)))
    images = [PILImage.new("RGB", size, (40 * k, 90, 160)) for k, size in enumerate(SIZES)]
    offsets = [adapter._call([image])["text_replacement_offsets"][0][0]["replacement"] for image in images]
    assert [adapter._replacements_seen([image])[0] for image in images] == offsets
    assert adapter._replacements_seen(images[:2]) == offsets[:2]


@pytest.mark.parametrize("kind", KINDS)
def test_a_processor_without_offsets_passes_the_start_up_check_with_the_same_tokens(kind, monkeypatch):
    import mmtune.models.authority as authority

    adapter = build_adapter(ModelConfig(family="auto", path=checkpoint(kind)))
    image = PILImage.new("RGB", (37, 53), (10, 200, 30))
    expected = adapter._replacement(53, 37)
    _without_offsets(adapter)
    assert "text_replacement_offsets" not in adapter._call([image])
    AutoAdapter._replacement.cache_clear()
    AutoAdapter._count.cache_clear()
    assert adapter._replacement(53, 37) == expected
    monkeypatch.setattr(authority, "_CHECKED", set())
    adapter._check_authority()  # the probe dialogue, token for token and input for input


def test_a_processor_whose_image_text_depends_on_its_neighbours_is_refused_at_start_up(tmp_path):
    """Idefics2's processor shares one ``<fake_token_around_image>`` between two adjacent images, so
    an image's text is not its own: refused with the reason, not a ``KeyError``."""
    from transformers import AutoConfig, Idefics2ImageProcessor, Idefics2Processor

    from mmtune.testing.tokenizers import class_tokenizer

    tokenizer = class_tokenizer(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<fake_token_around_image>",
                                 "<end_of_utterance>"), bos=None, eos="<|im_end|>", pad="<|endoftext|>", add_bos=False)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
                "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    image_processor = Idefics2ImageProcessor(size={"shortest_edge": 28, "longest_edge": 56}, do_image_splitting=False)
    Idefics2Processor(image_processor, tokenizer, image_seq_len=4, chat_template=template).save_pretrained(tmp_path)
    AutoConfig.for_model("idefics2", image_token_id=tokenizer.convert_tokens_to_ids("<image>")).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedProcessorError, match="the text that replaces an image depends on the other images"):
        build_adapter(ModelConfig(family="auto", path=str(tmp_path)))


def test_a_processor_that_numbers_the_images_of_a_call_is_followed_image_by_image(tmp_path):
    """MiniCPM-V writes each image's number into its text (``<image_id_start_token>k<image_id_end_token>``):
    the rule is found at start-up (checked on a call of twelve images), and a dialogue's k-th image gets
    number k, as the processor's call on the whole dialogue gives it."""
    from transformers import AutoConfig, MiniCPMV4_6ImageProcessor, MiniCPMV4_6Processor, MiniCPMV4_6VideoProcessor

    from mmtune.data.dialogue import Dialogue, Image, Turn
    from mmtune.data.encoding import encode_example
    from mmtune.testing.tokenizers import class_tokenizer

    named = {name: f"<{name}>" for name in ("image_start_token", "image_end_token", "image_id_start_token",
                                             "image_id_end_token", "slice_start_token", "slice_end_token",
                                             "video_token")}
    named["image_token"] = "<image>"
    tokenizer = class_tokenizer(("<|endoftext|>", "<|im_start|>", "<|im_end|>", *named.values()), bos=None,
                                eos="<|im_end|>", pad="<|endoftext|>", named_tokens=named, add_bos=False)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
                "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    processor = MiniCPMV4_6Processor(image_processor=MiniCPMV4_6ImageProcessor(max_slice_nums=2), tokenizer=tokenizer,
                                     video_processor=MiniCPMV4_6VideoProcessor(), chat_template=template)
    processor.save_pretrained(tmp_path)
    AutoConfig.for_model("minicpmv4_6", image_token_id=tokenizer.convert_tokens_to_ids("<image>")).save_pretrained(tmp_path)
    adapter = build_adapter(ModelConfig(family="auto", path=str(tmp_path)))
    assert adapter._index_rule == ("<image_id_start_token>", 0)
    files = []
    for k, size in enumerate([(40, 30), (30, 90), (64, 64)]):
        files.append(str(tmp_path / f"{k}.png"))
        PILImage.new("RGB", size, (50 * k, 100, 150)).save(files[-1])
    dialogue = Dialogue("d", "test", (Turn("user", ("Look ", Image(files[0]), Image(files[1]))),
                                      Turn("assistant", ("Two.",)), Turn("user", (Image(files[2]), "and?")),
                                      Turn("assistant", ("Three.",))))
    messages = [{"role": t.role, "content": [{"type": "image"} if isinstance(s, Image) else {"type": "text", "text": s}
                                             for s in t.segments]} for t in dialogue.turns]
    theirs = processor(text=[processor.apply_chat_template(messages, tokenize=False)],
                       images=[PILImage.open(f).convert("RGB") for f in files], return_tensors="pt")
    assert encode_example(adapter, dialogue, max_length=None).input_ids == theirs["input_ids"][0].tolist()
