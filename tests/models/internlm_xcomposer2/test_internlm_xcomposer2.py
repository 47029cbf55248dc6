"""Tiny InternLM-XComposer2: model, Partial LoRA, packing, template, RoPE, save/load, converter."""

import copy
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mmtune.data.dialogue import Dialogue, Image, Turn  # noqa: E402
from mmtune.models.base import IGNORE_INDEX, ImageChunk, TokenChunk  # noqa: E402
from mmtune.models.config import ModelConfig  # noqa: E402
from mmtune.models.internlm_xcomposer2 import (  # noqa: E402
    CheckpointMismatchError,
    InternLMXComposer2Adapter,
    InternLMXComposer2ForCausalLM,
    PartialLoRALinear,
    load_official_checkpoint,
)
from mmtune.models.registry import build_adapter  # noqa: E402


@pytest.fixture(scope="module")
def adapter():
    return build_adapter(ModelConfig(family="internlm_xcomposer2"))


@pytest.fixture()
def model(adapter):
    torch.manual_seed(0)
    m = adapter.load_model(attn_implementation="eager")
    _randomize_plora(m)
    return m.eval()


def _randomize_plora(model, scale=0.5):
    # Fresh Plora_B is zero (a no-op branch); tests need a live branch.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PartialLoRALinear):
                module.Plora_A.weight.normal_(0, scale)
                module.Plora_B.weight.normal_(0, scale)


def _dialogue(i=0, image_dir="/pics"):
    return Dialogue(
        f"d{i}",
        "test",
        (
            Turn("user", ("Image1: ", Image(f"{image_dir}/a{i}.png"), ". What colour is the shape?")),
            Turn("assistant", (f"It is red {i}.",)),
            Turn("user", ("Image2: ", Image(f"{image_dir}/b{i}.png"), " Compare the two images.")),
            Turn("assistant", ("The first image is a square, the second a circle.",)),
        ),
    )


def _flatten(adapter, encoded):
    ids, labels, n_images = [], [], 0
    chunks = list(encoded.prefix) + [c for t in encoded.turns for c in t.chunks] + list(encoded.suffix)
    for chunk in chunks:
        if isinstance(chunk, ImageChunk):
            ids += [adapter.image_token_id] * chunk.num_tokens
            labels += [IGNORE_INDEX] * chunk.num_tokens
            n_images += 1
        else:
            ids += list(chunk.ids)
            labels += list(chunk.ids) if chunk.trainable else [IGNORE_INDEX] * len(chunk)
    return ids, labels, n_images


def _pixels(n, size=56, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g)


def test_length_pass_counts_what_is_encoded(adapter):
    """``measure_many`` (the piece families' one length pass) gives the lengths ``encode_many`` does."""
    dialogues = [_dialogue(i) for i in range(3)]
    dialogues.append(Dialogue("text", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Hello",)),
                                            Turn("user", ("More?",)), Turn("assistant", ("No.",)))))
    for system_prompt in (None, "Be brief."):
        encoded = adapter.encode_many(dialogues, system_prompt=system_prompt)
        measured = adapter.measure_many(dialogues, system_prompt=system_prompt)
        for enc, (fixed, turns, images, roles) in zip(encoded, measured):
            assert roles == [t.role for t in enc.turns]
            assert turns == [sum(len(c) if isinstance(c, TokenChunk) else c.num_tokens for c in t.chunks)
                             for t in enc.turns]
            assert images == [sum(isinstance(c, ImageChunk) for c in t.chunks) for t in enc.turns]
            assert fixed + sum(turns) == len(_flatten(adapter, enc)[0])


# -- model --------------------------------------------------------------------------------------


def test_forward_backward_reaches_every_parameter(adapter):
    model = adapter.load_model()
    _randomize_plora(model, 0.1)
    model.train()
    ids, labels, n = _flatten(adapter, adapter.encode_dialogue(_dialogue()))
    out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), pixel_values=_pixels(n))
    assert out.logits.shape == (1, len(ids), adapter.model_config.text_config.vocab_size)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    no_grad = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert no_grad == []
    assert model.vit.vision_tower.embeddings.patch_embedding.weight.grad.abs().sum() > 0
    assert model.model.layers[0].attention.wqkv.Plora_A.weight.grad.abs().sum() > 0


def test_image_token_feature_mismatch_names_both_numbers(adapter, model):
    ids, _, n = _flatten(adapter, adapter.encode_dialogue(_dialogue()))
    with pytest.raises(ValueError, match=r"32 image tokens in input_ids, 16 features \(1 images x 16 tokens\)"):
        model(input_ids=torch.tensor([ids]), pixel_values=_pixels(1))
    with pytest.raises(ValueError, match="pixel_values is None"):
        model(input_ids=torch.tensor([ids]))


def test_partial_lora_linear_touches_only_masked_rows():
    torch.manual_seed(0)
    layer = PartialLoRALinear(8, 6, r=4, alpha=8.0, dropout=0.0)
    torch.nn.init.normal_(layer.Plora_B.weight)
    x = torch.randn(2, 5, 8)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1:3] = True
    mask[1, 4] = True
    out = layer(x, mask)
    base = torch.nn.functional.linear(x, layer.weight)
    assert torch.equal(out[~mask], base[~mask])
    expected = base[mask] + layer.Plora_B(layer.Plora_A(x[mask])) * 2.0
    torch.testing.assert_close(out[mask], expected)
    assert torch.equal(layer(x), base)  # no mask = all text


def test_partial_lora_weights_do_not_reach_text_before_first_image(adapter, model):
    ids, _, n = _flatten(adapter, adapter.encode_dialogue(_dialogue()))
    input_ids = torch.tensor([ids])
    first_image = ids.index(adapter.image_token_id)
    pixels = _pixels(n)
    with torch.no_grad():
        before = model(input_ids=input_ids, pixel_values=pixels).logits
        _randomize_plora(model, scale=1.0)
        after = model(input_ids=input_ids, pixel_values=pixels).logits
    # Causal attention: positions before the first image never see an image position,
    # and Partial LoRA is not applied at text positions, so they are bit-identical.
    assert torch.equal(before[0, :first_image], after[0, :first_image])
    # From the first image on, the branch (and what attends to it) changes the outputs.
    assert not torch.allclose(before[0, first_image], after[0, first_image])
    assert not torch.allclose(before[0, -1], after[0, -1])


def test_partial_lora_weights_do_not_change_text_only_sequences(adapter, model):
    dialogue = Dialogue("t", "test", (Turn("user", ("Describe the image.",)), Turn("assistant", ("No image.",))))
    ids, _, n = _flatten(adapter, adapter.encode_dialogue(dialogue))
    assert n == 0
    with torch.no_grad():
        before = model(input_ids=torch.tensor([ids])).logits
        _randomize_plora(model, scale=1.0)
        after = model(input_ids=torch.tensor([ids])).logits
    assert torch.equal(before, after)


def test_plora_gets_zero_not_none_gradients_on_text_only_batches(adapter):
    model = adapter.load_model()
    model.train()
    ids = adapter.tokenizer("What colour is it?")["input_ids"]
    out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids]))
    (out.loss + adapter.vision_dummy_loss(model)).backward()
    plora = [p for n, p in model.named_parameters() if "Plora" in n]
    assert plora and all(p.grad is not None and not p.grad.any() for p in plora)
    vision = list(model.vit.parameters()) + list(model.vision_proj.parameters())
    assert all(p.grad is not None and not p.grad.any() for p in vision)
    assert adapter.vision_dummy_loss(model).item() == 0.0


def test_fused_wqkv_matches_unfused_llama_attention(adapter):
    """The grouped wqkv layout, proven against transformers' Llama with split q/k/v weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = adapter.load_model(attn_implementation="eager").eval()
    text = model.config.text_config
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_hidden_layers=text.num_hidden_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=text.num_key_value_heads,
            rms_norm_eps=text.rms_norm_eps,
            max_position_embeddings=text.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": text.rope_parameters["rope_theta"]},
            attn_implementation="eager",
        )
    ).eval()
    heads, kv, d = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    groups = heads // kv
    state = {"model.embed_tokens.weight": model.model.tok_embeddings.weight, "model.norm.weight": model.model.norm.weight,
             "lm_head.weight": model.output.weight}  # fmt: skip
    for i, layer in enumerate(model.model.layers):
        wqkv = layer.attention.wqkv.weight.view(kv, groups + 2, d, text.hidden_size)
        prefix = f"model.layers.{i}."
        state[prefix + "self_attn.q_proj.weight"] = wqkv[:, :groups].reshape(heads * d, -1)
        state[prefix + "self_attn.k_proj.weight"] = wqkv[:, -2].reshape(kv * d, -1)
        state[prefix + "self_attn.v_proj.weight"] = wqkv[:, -1].reshape(kv * d, -1)
        state[prefix + "self_attn.o_proj.weight"] = layer.attention.wo.weight
        state[prefix + "mlp.gate_proj.weight"] = layer.feed_forward.w1.weight
        state[prefix + "mlp.up_proj.weight"] = layer.feed_forward.w3.weight
        state[prefix + "mlp.down_proj.weight"] = layer.feed_forward.w2.weight
        state[prefix + "input_layernorm.weight"] = layer.attention_norm.weight
        state[prefix + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
    missing, unexpected = llama.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    ids = torch.randint(5, text.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        reference = llama(input_ids=ids).logits
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_equals_unpacked(adapter, attn):
    torch.manual_seed(0)
    model = adapter.load_model(attn_implementation=attn).eval()
    _randomize_plora(model)
    samples = [_flatten(adapter, adapter.encode_dialogue(_dialogue(i))) for i in range(2)]
    pixels = [_pixels(n, seed=i) for i, (_, _, n) in enumerate(samples)]
    singles, total_loss, total_tokens = [], 0.0, 0
    with torch.no_grad():
        for (ids, labels, _), pv in zip(samples, pixels):
            out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), pixel_values=pv)
            singles.append(out.logits[0])
            count = sum(1 for label in labels[1:] if label != IGNORE_INDEX)
            total_loss += out.loss.item() * count
            total_tokens += count
        ids = samples[0][0] + samples[1][0]
        labels = samples[0][1] + samples[1][1]
        position_ids = list(range(len(samples[0][0]))) + list(range(len(samples[1][0])))
        packed = model(
            input_ids=torch.tensor([ids]),
            labels=torch.tensor([labels]),
            position_ids=torch.tensor([position_ids]),
            attention_mask=None,
            pixel_values=torch.cat(pixels),
        )
    torch.testing.assert_close(packed.logits[0], torch.cat(singles), rtol=1e-4, atol=1e-4)
    # the packed row's loss is the token-weighted mean of the two samples' losses
    assert packed.loss.item() == pytest.approx(total_loss / total_tokens, rel=1e-5)


def test_padding_batch_matches_single_rows(adapter, model):
    a_ids, _, na = _flatten(adapter, adapter.encode_dialogue(_dialogue(0)))
    short = Dialogue("s", "test", (Turn("user", (Image("/x.png"), "Hi")), Turn("assistant", ("Yes",))))
    b_ids, _, nb = _flatten(adapter, adapter.encode_dialogue(short))
    pad = adapter.tokenizer.pad_token_id
    length = max(len(a_ids), len(b_ids))
    batch = torch.tensor([a_ids + [pad] * (length - len(a_ids)), b_ids + [pad] * (length - len(b_ids))])
    mask = torch.tensor([[1] * len(a_ids) + [0] * (length - len(a_ids)), [1] * len(b_ids) + [0] * (length - len(b_ids))])
    pixels = torch.cat([_pixels(na, seed=1), _pixels(nb, seed=2)])
    with torch.no_grad():
        both = model(input_ids=batch, attention_mask=mask, pixel_values=pixels).logits
        single_b = model(input_ids=torch.tensor([b_ids]), pixel_values=_pixels(nb, seed=2)).logits
    torch.testing.assert_close(both[1, : len(b_ids)], single_b[0], rtol=1e-4, atol=1e-4)


def test_gradient_checkpointing_gives_the_same_gradients(adapter):
    ids, labels, n = _flatten(adapter, adapter.encode_dialogue(_dialogue()))
    grads = []
    for checkpointing in (False, True):
        model = adapter.load_model(seed=3)
        torch.manual_seed(5)
        _randomize_plora(model, 0.1)
        model.train()
        for module in model.modules():
            if hasattr(module, "lora_dropout"):
                module.lora_dropout.p = 0.0
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
            assert model.model.layers[0].gradient_checkpointing
        out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), pixel_values=_pixels(n))
        out.loss.backward()
        grads.append(model.model.layers[0].attention.wqkv.Plora_A.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_generate_with_kv_cache_matches_full_recompute(adapter, model):
    dialogue = Dialogue("g", "test", (Turn("user", ("Image1: ", Image("/a.png"), " What colour?")),))
    ids, _, n = _flatten(adapter, adapter.encode_dialogue(dialogue, add_generation_prompt=True))
    input_ids = torch.tensor([ids])
    pixels = _pixels(n)
    with torch.no_grad():
        generated = model.generate(
            input_ids=input_ids, pixel_values=pixels, max_new_tokens=6, do_sample=False, min_new_tokens=6,
            eos_token_id=None, pad_token_id=adapter.tokenizer.pad_token_id,
        )  # fmt: skip
        current = input_ids
        for _ in range(6):
            logits = model(input_ids=current, pixel_values=pixels, use_cache=False).logits
            current = torch.cat([current, logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, current)


# -- adapter ------------------------------------------------------------------------------------


def test_template_and_labels(adapter):
    encoded = adapter.encode_dialogue(_dialogue())
    ids, labels, n = _flatten(adapter, encoded)
    assert n == 2 and ids.count(adapter.image_token_id) == 2 * adapter.num_image_tokens
    assert ids[0] == adapter.tokenizer.bos_token_id and ids.count(adapter.tokenizer.bos_token_id) == 1
    text = adapter.tokenizer.decode([i for i in ids if i != adapter.image_token_id])
    assert text == (
        "<s>[UNUSED_TOKEN_146]user\nImage1: . What colour is the shape?[UNUSED_TOKEN_145]\n"
        "[UNUSED_TOKEN_146]assistant\nIt is red 0.[UNUSED_TOKEN_145]\n"
        "[UNUSED_TOKEN_146]user\nImage2:  Compare the two images.[UNUSED_TOKEN_145]\n"
        "[UNUSED_TOKEN_146]assistant\nThe first image is a square, the second a circle.[UNUSED_TOKEN_145]\n</s>"
    )
    # image runs stand exactly where the placeholders were, with no marker tokens around them
    first = ids.index(adapter.image_token_id)
    assert adapter.tokenizer.decode(ids[:first]).endswith("Image1: ")
    assert adapter.tokenizer.decode(ids[first + adapter.num_image_tokens :]).startswith(". What")


def test_label_spans_decode_to_assistant_texts(adapter):
    dialogue = _dialogue()
    _, labels, _ = _flatten(adapter, adapter.encode_dialogue(dialogue))
    spans, current = [], []
    for label in labels + [IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            spans.append(adapter.tokenizer.decode(current))
            current = []
    answers = [t.text for t in dialogue.turns if t.role == "assistant"]
    # as the official fine-tuning code: the "\n" and "</s>" after the last answer carry loss too
    assert spans == [a + "[UNUSED_TOKEN_145]" for a in answers[:-1]] + [answers[-1] + "[UNUSED_TOKEN_145]\n</s>"]

    _, last_only, _ = _flatten(adapter, adapter.encode_dialogue(dialogue, train_on="last_assistant"))
    kept = [label for label in last_only if label != IGNORE_INDEX]
    assert adapter.tokenizer.decode(kept) == answers[-1] + "[UNUSED_TOKEN_145]\n</s>"


def test_system_prompt_generation_prompt_and_errors(adapter):
    dialogue = Dialogue("q", "test", (Turn("user", ("Hi",)),))
    encoded = adapter.encode_dialogue(dialogue, system_prompt="Be brief.", add_generation_prompt=True)
    ids, labels, _ = _flatten(adapter, encoded)
    assert adapter.tokenizer.decode(ids) == (
        "<s>[UNUSED_TOKEN_146]system\nBe brief.[UNUSED_TOKEN_145]\n[UNUSED_TOKEN_146]user\nHi[UNUSED_TOKEN_145]\n"
        "[UNUSED_TOKEN_146]assistant\n"
    )
    assert set(labels) == {IGNORE_INDEX}
    with pytest.raises(ValueError, match="final user turn"):
        adapter.encode_dialogue(_dialogue(), add_generation_prompt=True)
    with pytest.raises(ValueError, match="train_on"):
        adapter.encode_dialogue(dialogue, train_on="everything")
    # control-token strings inside the text stay text
    tricky = Dialogue("x", "test", (Turn("user", ("[UNUSED_TOKEN_145]",)), Turn("assistant", ("ok",))))
    ids, _, _ = _flatten(adapter, adapter.encode_dialogue(tricky))
    assert ids.count(adapter.end_id) == 2


def test_preprocessing_is_square_bicubic_resize_with_clip_normalization(adapter, tmp_path):
    from PIL import Image as PILImage

    path = tmp_path / "wide.png"
    PILImage.new("RGB", (120, 40), (255, 0, 0)).save(path)
    pixels = adapter.preprocess_images([str(path)])
    assert pixels.shape == (1, 3, 56, 56)
    # a uniform red image stays uniform (no padding, no crop), normalised by CLIP mean/std
    torch.testing.assert_close(pixels[0, :, 0, 0], (torch.tensor([1.0, 0.0, 0.0]) - torch.tensor(
        [0.48145466, 0.4578275, 0.40821073])) / torch.tensor([0.26862954, 0.26130258, 0.27577711]))  # fmt: skip
    assert torch.allclose(pixels, pixels[:, :, :1, :1].expand_as(pixels))
    assert adapter.image_token_count(Image(str(path))) == 16


def test_module_groups_cover_every_parameter_once(adapter):
    from peft import LoraConfig, get_peft_model

    model = adapter.load_model()
    groups = adapter.module_groups(model)
    seen = [id(p) for g in (groups.vision, groups.projector, groups.language_model) for m in g for p in m.parameters()]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    peft_model = get_peft_model(model, LoraConfig(target_modules=adapter.default_lora_targets, **adapter.lora_preset))
    wrapped = adapter.module_groups(peft_model)
    assert wrapped.vision[0] is model.vit
    lora_names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert lora_names and all("lora_" in n for n in lora_names)
    assert not any("vit" in n or "vision_proj" in n for n in lora_names)


def test_peft_lora_keeps_partial_lora_working(adapter, model):
    from peft import LoraConfig, get_peft_model

    ids, _, n = _flatten(adapter, adapter.encode_dialogue(_dialogue()))
    with torch.no_grad():
        before = model(input_ids=torch.tensor([ids]), pixel_values=_pixels(n)).logits
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(target_modules=adapter.default_lora_targets, r=4))
    with torch.no_grad():  # LoRA B starts at zero: identical outputs, Plora still applied
        after = peft_model(input_ids=torch.tensor([ids]), pixel_values=_pixels(n)).logits
    torch.testing.assert_close(before, after)


# -- RoPE ---------------------------------------------------------------------------------------


def test_rope_scaling_reaches_the_rotary_module(adapter):
    from mmtune.models.rope import ContextConfig, apply_context_extension

    model = adapter.load_model()
    rotary = model.model.rotary_emb
    base = rotary.inv_freq.clone()
    assert rotary.rope_type == "dynamic"  # InternLM2's own setting (factor 1.0)

    ext = apply_context_extension(model, adapter.text_config(model.config), ContextConfig(max_length=8192, rope_scaling="linear"))
    assert ext.rotary_modules_rebuilt == 1 and ext.factor == 2.0
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, base / 2)

    model = adapter.load_model()
    apply_context_extension(model, adapter.text_config(model.config), ContextConfig(max_length=16384, rope_scaling="yarn"))
    assert model.model.rotary_emb.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_dynamic_rope_grows_base_past_the_window(adapter):
    config = ModelConfig(family="internlm_xcomposer2", architecture={"text_config": {"max_position_embeddings": 16}})
    model = InternLMXComposer2Adapter(config).load_model()
    rotary = model.model.rotary_emb
    base = rotary.inv_freq.clone()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1] + [5] * 9]))
        torch.testing.assert_close(rotary.inv_freq, base)  # inside the window: untouched
        model(input_ids=torch.tensor([[1] + [5] * 40]))
    assert (rotary.inv_freq[1:] < base[1:]).all()  # NTK: a larger base past the window


# -- save / load / convert ----------------------------------------------------------------------


def test_save_and_reload_round_trip(adapter, model, tmp_path):
    model.save_pretrained(tmp_path)
    adapter.save_pretrained(str(tmp_path))
    reloaded_adapter = build_adapter(ModelConfig(family="internlm_xcomposer2", path=str(tmp_path)))
    assert reloaded_adapter.image_token_id == adapter.image_token_id
    assert reloaded_adapter.encode_dialogue(_dialogue()) == adapter.encode_dialogue(_dialogue())
    reloaded = reloaded_adapter.load_model(attn_implementation="eager").eval()
    ids, _, n = _flatten(adapter, adapter.encode_dialogue(_dialogue()))
    with torch.no_grad():
        a = model(input_ids=torch.tensor([ids]), pixel_values=_pixels(n)).logits
        b = reloaded(input_ids=torch.tensor([ids]), pixel_values=_pixels(n)).logits
    assert torch.equal(a, b)
    assert reloaded.config.text_config.rope_parameters == model.config.text_config.rope_parameters


def _official_checkpoint(model, directory, *, grid=None, extra=None, drop=None, shards=2):
    """Write ``model``'s weights under the official names, as the official code saves them."""
    from safetensors.torch import save_file

    state = {}
    for key, value in model.state_dict().items():
        state[key.replace("vit.vision_tower.", "vit.vision_tower.vision_model.", 1)] = value.clone()
    prefix = "vit.vision_tower.vision_model."
    hidden = model.config.vision_config.hidden_size
    state[prefix + "post_layernorm.weight"] = torch.ones(hidden)
    state[prefix + "post_layernorm.bias"] = torch.zeros(hidden)
    state[prefix + "embeddings.position_ids"] = torch.arange(17).unsqueeze(0)
    state["model.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(8)
    if grid is not None:
        state[prefix + "embeddings.position_embedding.weight"] = torch.randn(grid * grid + 1, hidden)
    state.update(extra or {})
    for key in drop or ():
        del state[key]
    keys = sorted(state)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k].contiguous() for k in keys[s::shards]}
        save_file(part, os.path.join(directory, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)
    text = model.config.text_config
    official = {
        "architectures": ["InternLMXComposer2ForCausalLM"], "model_type": "internlmxcomposer2",
        "vocab_size": text.vocab_size, "hidden_size": text.hidden_size, "intermediate_size": text.intermediate_size,
        "num_hidden_layers": text.num_hidden_layers, "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads, "rms_norm_eps": text.rms_norm_eps,
        "max_position_embeddings": text.max_position_embeddings, "rope_theta": 1000000,
        "rope_scaling": {"type": "dynamic", "factor": 1.0}, "bias": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2,
    }  # fmt: skip
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(official, handle)
    return state


def _tiny_vision_override(model):
    return {k: v for k, v in model.config.vision_config.to_dict().items() if k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size", "projection_dim")}  # fmt: skip


def test_official_state_dict_loads_with_no_missing_keys(adapter, model, tmp_path, monkeypatch):
    import mmtune.models.internlm_xcomposer2 as xc2

    official = _official_checkpoint(model, tmp_path)
    assert any(k.startswith("vit.vision_tower.vision_model.") for k in official)
    # the official config has no vision sizes (ViT-L/14 is implied); patch in the tiny ones
    monkeypatch.setattr(xc2.conversion, "CLIP_VIT_L_14", {**xc2.conversion.CLIP_VIT_L_14, **_tiny_vision_override(model)})
    loaded = load_official_checkpoint(str(tmp_path), image_size=56, attn_implementation="eager")
    assert loaded.config.text_config.plora_r == model.config.text_config.plora_r
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids, _, n = _flatten(adapter, adapter.encode_dialogue(_dialogue()))
    with torch.no_grad():
        a = model(input_ids=torch.tensor([ids]), pixel_values=_pixels(n)).logits
        b = loaded(input_ids=torch.tensor([ids]), pixel_values=_pixels(n)).logits
    torch.testing.assert_close(a, b)


def test_official_position_embeddings_are_resized_bicubically_keeping_cls(model, tmp_path, monkeypatch):
    import mmtune.models.internlm_xcomposer2 as xc2

    official = _official_checkpoint(model, tmp_path, grid=3)  # a 3x3 grid, resized to the 4x4 of 56 px
    monkeypatch.setattr(xc2.conversion, "CLIP_VIT_L_14", {**xc2.conversion.CLIP_VIT_L_14, **_tiny_vision_override(model)})
    loaded = load_official_checkpoint(str(tmp_path), image_size=56)
    weight = loaded.vit.vision_tower.embeddings.position_embedding.weight
    source = official["vit.vision_tower.vision_model.embeddings.position_embedding.weight"]
    assert weight.shape == (17, source.shape[1])
    assert torch.equal(weight[0], source[0])
    grid = source[1:].reshape(1, 3, 3, -1).permute(0, 3, 1, 2)
    expected = torch.nn.functional.interpolate(grid, size=(4, 4), mode="bicubic", align_corners=False)
    torch.testing.assert_close(weight[1:], expected.permute(0, 2, 3, 1).reshape(16, -1))


def test_official_checkpoint_errors_list_every_problem(model, tmp_path, monkeypatch):
    import mmtune.models.internlm_xcomposer2 as xc2

    _official_checkpoint(
        model,
        tmp_path,
        drop=["model.layers.1.feed_forward.w2.Plora_B.weight"],
        extra={"model.plora_glb_GN": torch.zeros(1, 1, 64), "output.weight": torch.zeros(3, 64)},
    )
    monkeypatch.setattr(xc2.conversion, "CLIP_VIT_L_14", {**xc2.conversion.CLIP_VIT_L_14, **_tiny_vision_override(model)})
    with pytest.raises(CheckpointMismatchError) as err:
        load_official_checkpoint(str(tmp_path), image_size=56)
    message = str(err.value)
    assert "missing (1): model.layers.1.feed_forward.w2.Plora_B.weight" in message
    assert "unexpected (1): model.plora_glb_GN" in message
    assert "output.weight: checkpoint (3, 64) vs model (512, 64)" in message


def test_official_checkpoint_through_the_adapter_needs_an_image_size(model, tmp_path):
    _official_checkpoint(model, tmp_path)
    model_tok = build_adapter(ModelConfig(family="internlm_xcomposer2")).tokenizer
    model_tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="set model.internlm_xcomposer2.image_size"):
        build_adapter(ModelConfig(family="internlm_xcomposer2", path=str(tmp_path)))


def test_tiny_config_yaml_builds_the_tiny_model():
    from omegaconf import OmegaConf

    root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "model")
    for name in ("internlm_xc2_tiny", "internlm_xc2_vl_7b", "internlm_xc2_7b"):
        cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig()), OmegaConf.load(os.path.join(root, f"{name}.yaml")))
        assert cfg.family == "internlm_xcomposer2"
    tiny = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig()), OmegaConf.load(os.path.join(root, "internlm_xc2_tiny.yaml")))
    )
    adapter = build_adapter(tiny)
    assert adapter.num_image_tokens == 16
    assert isinstance(adapter.load_model(), InternLMXComposer2ForCausalLM)


def test_token_chunks_are_plain_contract_types(adapter):
    encoded = adapter.encode_dialogue(_dialogue())
    for chunk in encoded.prefix + [c for t in encoded.turns for c in t.chunks] + encoded.suffix:
        assert isinstance(chunk, (TokenChunk, ImageChunk))
        if isinstance(chunk, TokenChunk):
            assert chunk.ids and all(isinstance(i, int) for i in chunk.ids)
    assert [t.role for t in encoded.turns] == ["user", "assistant", "user", "assistant"]
    assert encoded.length == len(_flatten(adapter, encoded)[0])


# -- through the shared collator ------------------------------------------------------------------


def test_collated_packed_batch_equals_padded_batch(adapter, model, tmp_path):
    """The tiny XC2 through mmtune's encoder and collator: packing changes nothing."""
    import dataclasses

    from PIL import Image as PILImage

    from mmtune.data.collator import MultiImageCollator, model_inputs
    from mmtune.data.encoding import encode_examples
    from mmtune.data.images import ImagePipeline

    colours = [(255, 0, 0), (0, 128, 255), (20, 200, 20), (90, 90, 90)]
    for i, colour in enumerate(colours):
        PILImage.new("RGB", (64, 48), colour).save(tmp_path / f"a{i}.png")
        PILImage.new("RGB", (30, 70), colour[::-1]).save(tmp_path / f"b{i}.png")
    dialogues = [_dialogue(i, image_dir=str(tmp_path)) for i in range(3)]
    examples = encode_examples(adapter, dialogues, max_length=512)
    pipeline = ImagePipeline(adapter)
    # the pipeline caches uint8 pixels and normalises them exactly as preprocess_images does
    assert torch.equal(pipeline.load(examples[0].images), adapter.preprocess_images([r.path for r in examples[0].images]))
    padded = MultiImageCollator(adapter.tokenizer.pad_token_id, image_pipeline=pipeline)(examples)
    packed = MultiImageCollator(adapter.tokenizer.pad_token_id, packed=True, image_pipeline=pipeline)(
        [dataclasses.replace(e, row=0) for e in examples]
    )
    assert packed["attention_mask"] is None and packed["input_ids"].shape[0] == 1
    assert int(packed["num_loss_tokens"]) == int(padded["num_loss_tokens"])
    with torch.no_grad():
        loss_padded = model(**model_inputs(padded)).loss
        loss_packed = model(**model_inputs(packed)).loss
    assert loss_packed.item() == pytest.approx(loss_padded.item(), rel=1e-5)


def test_converted_official_checkpoint_loads_through_the_adapter(adapter, model, tmp_path, monkeypatch):
    import mmtune.models.internlm_xcomposer2 as xc2

    src, dst = tmp_path / "official", tmp_path / "native"
    src.mkdir()
    _official_checkpoint(model, src, shards=1)
    adapter.tokenizer.save_pretrained(src)
    monkeypatch.setattr(xc2.conversion, "CLIP_VIT_L_14", {**xc2.conversion.CLIP_VIT_L_14, **_tiny_vision_override(model)})
    xc2.convert_official_checkpoint(str(src), str(dst), image_size=56, dtype="float32")
    native = build_adapter(ModelConfig(family="internlm_xcomposer2", path=str(dst)))
    reloaded = native.load_model(attn_implementation="eager").eval()
    ids, _, n = _flatten(native, native.encode_dialogue(_dialogue()))
    with torch.no_grad():
        a = model(input_ids=torch.tensor([ids]), pixel_values=_pixels(n)).logits
        b = reloaded(input_ids=torch.tensor([ids]), pixel_values=_pixels(n)).logits
    assert torch.equal(a, b)


def test_quantized_loading_is_refused_with_the_reason(adapter):
    with pytest.raises(NotImplementedError, match="Partial LoRA layers"):
        adapter.load_model(quantization_config=object())


def test_context_window_below_the_pretrained_one_keeps_dynamic_rope(adapter):
    from mmtune.models.rope import ContextConfig, apply_context_extension

    model = adapter.load_model()
    base = model.model.rotary_emb.inv_freq.clone()
    apply_context_extension(model, adapter.text_config(model.config), ContextConfig(max_length=2048))
    assert model.model.rotary_emb.rope_type == "dynamic"
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, base)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 5, 6]])).logits).all()
