"""Context extension reaches the rotary-embedding module and survives save/reload."""

import math

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from mmtune.models.rope import ContextConfig, apply_context_extension

ORIGINAL = 256


def _tiny_llava() -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=128, max_position_embeddings=ORIGINAL)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=28, patch_size=14)
    return LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_id=3)).eval()


def _rotary(model):
    return model.model.language_model.rotary_emb


def test_linear_scaling_divides_positions_by_factor():
    model = _tiny_llava()
    before = _rotary(model).inv_freq.clone()
    ext = apply_context_extension(model, model.config.text_config, ContextConfig(max_length=4 * ORIGINAL))
    assert (ext.original, ext.target, ext.factor, ext.rope_type) == (ORIGINAL, 4 * ORIGINAL, 4.0, "linear")
    assert ext.rotary_modules_rebuilt == 1
    torch.testing.assert_close(_rotary(model).inv_freq, before / 4.0)
    # Position p under linear scaling == position p/4 before: compare cos/sin directly.
    x = torch.zeros(1, 1, 32)
    cos_scaled, _ = _rotary(model)(x, torch.tensor([[8]]))
    fresh = _tiny_llava()
    cos_plain, _ = _rotary(fresh)(x, torch.tensor([[2]]))
    torch.testing.assert_close(cos_scaled, cos_plain)
    assert model.config.text_config.max_position_embeddings == 4 * ORIGINAL


def test_yarn_sets_attention_factor_and_dynamic_keeps_window():
    model = _tiny_llava()
    apply_context_extension(model, model.config.text_config, ContextConfig(max_length=2 * ORIGINAL, rope_scaling="yarn"))
    assert _rotary(model).attention_scaling == pytest.approx(0.1 * math.log(2.0) + 1.0)
    assert model.config.text_config.rope_parameters["original_max_position_embeddings"] == ORIGINAL

    model = _tiny_llava()
    before = _rotary(model).inv_freq.clone()
    apply_context_extension(model, model.config.text_config, ContextConfig(max_length=2 * ORIGINAL, rope_scaling="dynamic"))
    rotary = _rotary(model)
    assert rotary.rope_type == "dynamic" and model.config.text_config.max_position_embeddings == ORIGINAL
    x = torch.zeros(1, 1, 32)
    rotary(x, torch.arange(ORIGINAL)[None])  # within the original window: unchanged
    torch.testing.assert_close(rotary.inv_freq, before)
    rotary(x, torch.arange(2 * ORIGINAL)[None])  # beyond it: the base grows, frequencies drop
    assert torch.all(rotary.inv_freq[1:] < before[1:])


def test_scaling_survives_save_and_reload(tmp_path):
    model = _tiny_llava()
    apply_context_extension(model, model.config.text_config, ContextConfig(max_length=2 * ORIGINAL, rope_scaling="yarn"))
    expected_inv, expected_scale = _rotary(model).inv_freq.clone(), _rotary(model).attention_scaling
    model.save_pretrained(tmp_path)
    reloaded = LlavaForConditionalGeneration.from_pretrained(tmp_path)
    assert reloaded.config.text_config.rope_parameters["rope_type"] == "yarn"
    torch.testing.assert_close(_rotary(reloaded).inv_freq, expected_inv)
    assert _rotary(reloaded).attention_scaling == pytest.approx(expected_scale)
    ids = torch.randint(4, 128, (1, 12))
    torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_no_target_changes_nothing_and_bad_type_is_rejected():
    model = _tiny_llava()
    assert apply_context_extension(model, model.config.text_config, ContextConfig(max_length=None)) is None
    with pytest.raises(ValueError, match="context.rope_scaling"):
        apply_context_extension(model, model.config.text_config, ContextConfig(max_length=512, rope_scaling="ntk"))


@pytest.mark.parametrize("family", ["llava", "internlm_xcomposer2"])
def test_context_extension_stays_with_its_own_adapter(family):
    """What one run changes on its adapter's tokenizer and model (the window a context
    extension sets, an added token) is not seen by the next adapter built in the process."""
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    first = build_adapter(ModelConfig(family=family))
    default_length, vocab = first.tokenizer.model_max_length, len(first.tokenizer)
    model = first.load_model()
    text_config = first.text_config(model.config)
    window = text_config.max_position_embeddings
    apply_context_extension(model, text_config, ContextConfig(max_length=4 * window), tokenizer=first.tokenizer)
    first.tokenizer.add_tokens(["<only-in-the-first-adapter>"])
    assert first.tokenizer.model_max_length == 4 * window and text_config.max_position_embeddings == 4 * window

    second = build_adapter(ModelConfig(family=family))
    assert second.tokenizer is not first.tokenizer
    assert second.tokenizer.model_max_length == default_length
    assert len(second.tokenizer) == vocab and "<only-in-the-first-adapter>" not in second.tokenizer.get_vocab()
    assert second.text_config(second.model_config).max_position_embeddings == window
    assert second.tokenizer("USER: hello")["input_ids"] == build_adapter(ModelConfig(family=family)).tokenizer(
        "USER: hello"
    )["input_ids"]
