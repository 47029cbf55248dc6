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
    import mmtune.models.auto.authority as authority

    adapter = build_adapter(ModelConfig(family="auto", path=checkpoint(kind)))
    image = PILImage.new("RGB", (37, 53), (10, 200, 30))
    expected = adapter._replacement(53, 37)
    _without_offsets(adapter)
    assert "text_replacement_offsets" not in adapter._call([image])
    AutoAdapter._replacement.cache_clear()
    AutoAdapter._count.cache_clear()
    assert adapter._replacement(53, 37) == expected
    monkeypatch.setattr(authority, "_CHECKED", set())
    adapter._check_against_processor()  # the probe dialogue, token for token and input for input


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
