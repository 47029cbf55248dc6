"""Generation for the ``auto`` family's tested classes (tiny random-weight checkpoints of every class of ``mmtune.testing.checkpoints.KINDS``): batched
KV answers equal batch 1 and re-encoding, record for record.

Greedy decoding in fp32. The dialogues differ in turns, images per turn (of different sizes:
different tile counts) and text length; one overflows the window, so its row is rolled back to
a common prefix. The stop token's output row is scaled up so answers stop at different steps.
"""

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from mmtune.evaluation.generation.config import GenerationConfig
from mmtune.evaluation.generation.generator import DialogueGenerator
from tests.support.auto_checkpoints import adapter, cases
from tests.support.dialogues import numbered_dialogue


@pytest.fixture(scope="module")
def dialogues(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto_gen")
    paths = []
    rng = np.random.default_rng(0)
    for i, (width, height) in enumerate([(36, 30), (90, 40), (30, 120), (64, 64)]):
        path = root / f"{i}.png"
        PILImage.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))

    return [numbered_dialogue(paths, k, images, words=words, name=name) for k, images, words, name in [
        (0, [1], 1, None), (1, [2, 0], 1, None), (2, [1, 0, 1], 3, None), (3, [0, 1], 1, None), (4, [0, 0], 5, None),
        (5, [2, 1, 2, 1, 0], 4, "long")]]


def _fields(records):
    return [(r.dialogue_id, r.turn, r.answer, r.prompt_tokens, r.new_tokens, r.finish_reason, r.context) for r in records]


def _run(auto, model, dialogues, window, **settings):
    cfg = GenerationConfig(max_new_tokens=6, context_length=window, min_new_tokens=6,
                           **{"batch_schedule": "continuous", **settings})
    gen = DialogueGenerator(auto, model, cfg)
    return gen.generate(dialogues), {**gen.stats, "kv_note": gen.kv_note}




@pytest.mark.parametrize("kind", cases("batched_kv"))
def test_batched_kv_matches_batch1_and_reencode(kind, dialogues):
    auto = adapter(kind)
    model = auto.load_model().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[auto.stop_token_ids[0]] *= 3.0
    window = _window(auto, dialogues)  # every dialogue fits but the long one
    one, one_stats = _run(auto, model, dialogues, window, batch_size=1)
    batched, stats = _run(auto, model, dialogues, window, batch_size=4)
    reencoded, _ = _run(auto, model, dialogues, window, kv_reuse=False, batch_size=3)
    assert "long" in {r.dialogue_id for r in one if r.context}
    assert stats["padding_tokens"] > 0
    assert _fields(batched) == _fields(one) == _fields(reencoded)
    assert stats["forward_calls"] < one_stats["forward_calls"]
    if _recurrent(auto):  # the batched path is re-encoding, stated at start-up
        assert "recurrent" in stats["kv_note"] and one_stats["kv_note"] is None
        assert [r.forward_tokens for r in batched] == [r.forward_tokens for r in reencoded]
    else:
        assert stats["kv_note"] is None
        assert [r.forward_tokens for r in batched] == [r.forward_tokens for r in one]


def _recurrent(auto) -> bool:
    """Whether the language model has recurrent layers (Gated DeltaNet's linear attention, LFM2's short
    convolution: their cache layers hold a state): its rows cannot share a KV cache."""
    layer_types = getattr(auto.text_config(auto.model_config), "layer_types", None) or []
    return bool({"linear_attention", "conv"} & set(layer_types))


def _window(auto, dialogues):
    """Between the longest short dialogue and the long one, in tokens."""
    from mmtune.data.encoding import encode_example

    sizes = {d.id: len(encode_example(auto, d, max_length=None)) for d in dialogues}
    short = max(n for name, n in sizes.items() if name != "long")
    assert sizes["long"] > short + 20, sizes
    return (short + sizes["long"]) // 2 + 8


def _own_ours_and_causal_logits(model, gen, length: int = 60):
    """Logits of one unpadded row under the model's own masks, the generator's per-row masks and a plain causal mask."""
    ids = torch.randint(10, 200, (1, length))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        ours = model(input_ids=ids, attention_mask=gen._windowed_masks(torch.ones_like(ids), length)).logits
        causal_mask = torch.ones_like(ids)[:, None, None].expand(1, 1, length, length).tril().bool()
        causal = model(input_ids=ids, attention_mask=causal_mask).logits
    return own, ours, causal


@pytest.mark.parametrize("layer_types", [("sliding_attention", "sliding_attention"),
                                         ("sliding_attention", "full_attention")])
def test_windowed_masks_equal_the_models_own_on_one_row(layer_types):
    """Gemma 3's sliding-window layers (every layer one type: one mask; mixed: transformers'
    mapping of layer type to mask): the masks the generator builds from a row's own tokens give
    the logits of transformers' own masks on an unpadded row (window 16, 60 tokens)."""
    import copy

    from transformers import AutoModelForImageTextToText

    auto = adapter("gemma3")
    config = copy.deepcopy(auto.load_model().config)
    config.text_config.layer_types = list(layer_types)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()
    gen = DialogueGenerator(auto, model, GenerationConfig(max_new_tokens=1))
    assert gen._windows == {kind: 16 if kind == "sliding_attention" else None for kind in layer_types}
    own, ours, causal = _own_ours_and_causal_logits(model, gen)
    torch.testing.assert_close(ours, own, rtol=0, atol=1e-5)
    assert not torch.allclose(causal, own, atol=1e-3), "the window changes the logits (the test can tell)"


def test_chunked_masks_equal_the_models_own_on_one_row():
    """Llama 4's chunked-attention layers (chunk 16 here, 60 tokens): the masks the generator builds
    from a row's own tokens give the logits of transformers' own chunked masks on an unpadded row."""
    import copy

    from transformers import AutoModelForImageTextToText

    auto = adapter("llama4")
    config = copy.deepcopy(auto.load_model().config)
    config.text_config.attention_chunk_size = 16
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()
    gen = DialogueGenerator(auto, model, GenerationConfig(max_new_tokens=1, context_length=100))
    assert gen._chunks == {"chunked_attention": 16} and "chunked_attention" in gen._windows
    own, ours, causal = _own_ours_and_causal_logits(model, gen)
    torch.testing.assert_close(ours, own, rtol=0, atol=1e-5)
    assert not torch.allclose(causal, own, atol=1e-3), "the chunks change the logits (the test can tell)"


def test_llama4_batches_only_within_its_temperature_tuning_scale():
    """Past floor_scale cache columns Llama 4's NoPE layers scale queries by the shared cache length:
    with a context that can reach it, batched KV runs as batch 1 and says why."""
    auto = adapter("llama4")
    model = auto.load_model().eval()
    floor = int(auto.text_config(model.config).floor_scale)
    within = DialogueGenerator(auto, model, GenerationConfig(batch_size=4, context_length=floor - 1))
    beyond = DialogueGenerator(auto, model, GenerationConfig(batch_size=4, context_length=floor + 100))
    assert within.batch_size == 4 and within.batch_note is None
    assert beyond.batch_size == 1 and "floor_scale" in beyond.batch_note
