"""Per-sample attention over packed rows: the same loss and gradients as every sample alone and as
transformers' block mask (both families, with images, sdpa and eager, gradient checkpointing, LoRA,
bf16 autocast), no 4-D mask and only the samples' own attention work; selection and its errors."""

import copy
from dataclasses import replace

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.collator import MultiImageCollator, model_inputs
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import Example, encode_example
from mmtune.data.images import ImagePipeline
from mmtune.models.base import IGNORE_INDEX
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from mmtune.training.loss import materialized_cross_entropy_sum
from mmtune.training.packed_attention import (
    PACKED_IMPLEMENTATIONS,
    PackedSegments,
    language_model,
    model_support_problem,
    register_packed_attention,
    resolve_attention,
    use_attention,
)

FAMILIES = ["llava", "internlm_xcomposer2"]
# Partial LoRA's dropout off: packed and alone runs must see the same (no) dropout masks.
ARCHITECTURE = {"internlm_xcomposer2": {"text_config": {"plora_dropout": 0.0}}}


@pytest.fixture(scope="module")
def image_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed_attention")
    paths = []
    for k, colour in enumerate([(255, 0, 0), (0, 200, 0), (0, 0, 255)]):
        path = root / f"{k}.png"
        PILImage.new("RGB", (40 + 12 * k, 48), colour).save(path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


def _adapter(family):
    return build_adapter(ModelConfig(family=family, architecture=ARCHITECTURE.get(family, {})))


def _model(adapter, attn):
    model = adapter.load_model(seed=0, attn_implementation=attn)
    with torch.no_grad():  # Partial LoRA starts at zero (a no-op); give its image-only branch a say
        for name, param in model.named_parameters():
            if "Plora_B" in name:
                param.normal_(0, 0.2)
    return model.train()


def _examples(adapter, paths):
    """Samples of different lengths with 0, 1 and 2 images, a 1-token sample, and two of one length."""
    dialogues = [
        Dialogue("a", "t", (Turn("user", (Image(paths[0]), "What colour is it?")), Turn("assistant", ("red",)))),
        Dialogue("b", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Hello there. Yes",)),
                            Turn("user", ("Both: ", Image(paths[1]), Image(paths[2]))),
                            Turn("assistant", ("green and blue",)))),
        Dialogue("c", "t", (Turn("user", ("Only text here",)), Turn("assistant", ("ok",)))),
        Dialogue("d", "t", (Turn("user", ("Only text here",)), Turn("assistant", ("no",)))),
    ]
    pipe = ImagePipeline(adapter)
    out = []
    for d in dialogues:
        e = encode_example(adapter, d, max_length=4096)
        out.append(replace(e, pixel_values=pipe.load(e.images, dialogue_id=d.id)))
    out.append(Example("one-token", [out[2].input_ids[0]], [IGNORE_INDEX]))
    assert len(out[2]) == len(out[3]), "c and d should be one length (they share a kernel call)"
    return out


# Row 0: a, one-token, c; row 1: b, d and the row padding (a sample of its own).
ROWS = [0, 1, 0, 1, 0]


def _packed_batch(adapter, examples):
    pad = adapter.tokenizer.pad_token_id
    ordered = [examples[i] for i in (0, 4, 2, 1, 3)]
    rows = [0, 0, 0, 1, 1]
    batch = MultiImageCollator(pad, packed=True)([replace(e, row=r) for e, r in zip(ordered, rows)])
    lengths = [sum(len(e) for e, r in zip(ordered, rows) if r == k) for k in (0, 1)]
    assert lengths[0] != lengths[1], "one row should carry padding"
    return batch, ordered, rows


def _loss_and_grads(model, batches):
    """Summed next-token loss over ``batches`` and every parameter's gradient of it."""
    model.zero_grad(set_to_none=True)
    total, logits = 0.0, []
    for batch in batches:
        out = model(**model_inputs(batch))
        loss = materialized_cross_entropy_sum(out.logits, batch["labels"])
        loss.backward()
        total += float(loss.detach())
        logits.append(out.logits.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads, logits


def _assert_same(a, b, what):
    (loss_a, grads_a, _), (loss_b, grads_b, _) = a, b
    assert loss_a == pytest.approx(loss_b, rel=1e-6, abs=1e-5), what
    assert grads_a.keys() == grads_b.keys() and grads_a, what
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-5, msg=f"{what}: {name}")


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_equal_each_sample_alone_and_the_block_mask(family, image_paths, attn, checkpointing):
    adapter = _adapter(family)
    model = _model(adapter, attn)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    examples = _examples(adapter, image_paths)
    packed, ordered, rows = _packed_batch(adapter, examples)
    assert packed["pixel_values"] is not None
    lm = language_model(model, adapter.text_config(model.config))

    block = _loss_and_grads(model, [packed])
    with use_attention(lm, PACKED_IMPLEMENTATIONS[attn]):
        per_sample = _loss_and_grads(model, [packed])
    assert lm.config._attn_implementation == attn  # restored
    alone = _loss_and_grads(model, [MultiImageCollator(adapter.tokenizer.pad_token_id)([e]) for e in ordered])

    _assert_same(per_sample, alone, "per-sample vs each sample alone")
    _assert_same(per_sample, block, "per-sample vs block mask")
    # every logit of every sample, and of the padding segment
    starts = {0: 0, 1: 0}
    for example, row, logits in zip(ordered, rows, alone[2]):
        n = len(example)
        torch.testing.assert_close(per_sample[2][0][row, starts[row]:starts[row] + n], logits[0], rtol=1e-5, atol=1e-5)
        starts[row] += n
    torch.testing.assert_close(per_sample[2][0], block[2][0], rtol=1e-5, atol=1e-5)


def test_the_auto_adapter_model_trains_per_sample(tmp_path, image_paths):
    """A checkpoint loaded by the generic adapter: its language model uses transformers' registries."""
    llava = _adapter("llava")
    llava.load_model(seed=0).save_pretrained(tmp_path)
    llava.save_pretrained(tmp_path)
    adapter = build_adapter(ModelConfig(family="auto", path=str(tmp_path)))
    model = adapter.load_model().train()
    text_config = adapter.text_config(model.config)
    assert model_support_problem(model, text_config) == ""
    packed, ordered, _ = _packed_batch(adapter, _examples(adapter, image_paths))
    assert packed["pixel_values"] is not None
    block = _loss_and_grads(model, [packed])
    with use_attention(language_model(model, text_config), "mmtune_packed_sdpa"):
        per_sample = _loss_and_grads(model, [packed])
    alone = _loss_and_grads(model, [MultiImageCollator(adapter.tokenizer.pad_token_id)([e]) for e in ordered])
    _assert_same(per_sample, alone, "auto adapter: per-sample vs each sample alone")
    _assert_same(per_sample, block, "auto adapter: per-sample vs block mask")


def test_lora_gradients_equal_the_block_mask(family, image_paths):
    from peft import LoraConfig, get_peft_model

    adapter = _adapter(family)
    base = _model(adapter, "sdpa")
    targets = [n for n, _ in base.named_modules() if n.endswith(("q_proj", "v_proj", "wqkv", "wo"))
               and "vision" not in n and not n.startswith("vit")]
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    with torch.no_grad():  # peft starts B at zero, which would hide A's gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    packed, _, _ = _packed_batch(adapter, _examples(adapter, image_paths))
    block = _loss_and_grads(model, [packed])
    with use_attention(language_model(model, adapter.text_config(base.config)), "mmtune_packed_sdpa"):
        per_sample = _loss_and_grads(model, [packed])
    assert any("lora_A" in n for n in per_sample[1])
    _assert_same(per_sample, block, "LoRA per-sample vs block mask")


def test_bf16_autocast_is_as_accurate_as_the_block_mask(image_paths):
    adapter = _adapter("llava")
    model = _model(adapter, "sdpa")
    packed, _, _ = _packed_batch(adapter, _examples(adapter, image_paths))
    lm = language_model(model, adapter.text_config(model.config))
    exact = _loss_and_grads(model, [packed])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        block = _loss_and_grads(model, [packed])
        with use_attention(lm, "mmtune_packed_sdpa"):
            per_sample = _loss_and_grads(model, [packed])
    assert abs(per_sample[0] - exact[0]) <= 2 * abs(block[0] - exact[0]) + 1e-3 * abs(exact[0])
    for name, grad in exact[1].items():
        err_per_sample = (per_sample[1][name] - grad).abs().max()
        err_block = (block[1][name] - grad).abs().max()
        assert err_per_sample <= 2 * err_block + 1e-3 * grad.abs().max() + 1e-6, name


# -- what runs: no 4-D mask, only the samples' own attention scores ---------------------------------


class _Recorder:
    """Wraps transformers' ``sdpa`` attention function and mask builder (both looked up at call time)."""

    def __init__(self, monkeypatch):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        self.calls, self.masks_built = [], 0
        attention, mask = AttentionInterface._global_mapping["sdpa"], AttentionMaskInterface._global_mapping["sdpa"]

        def recording_attention(module, query, key, value, attention_mask, *args, **kwargs):
            self.calls.append((type(module).__name__, tuple(query.shape), tuple(key.shape), attention_mask))
            return attention(module, query, key, value, attention_mask, *args, **kwargs)

        def counting_mask(*args, **kwargs):
            self.masks_built += 1
            return mask(*args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", recording_attention)
        monkeypatch.setitem(AttentionMaskInterface._global_mapping, "sdpa", counting_mask)

    def language_calls(self, vision_class):
        return [c for c in self.calls if c[0] != vision_class]


def test_no_4d_mask_and_only_the_samples_attention_scores(family, image_paths, monkeypatch):
    adapter = _adapter(family)
    model = _model(adapter, "sdpa")
    packed, ordered, _ = _packed_batch(adapter, _examples(adapter, image_paths))
    lm = language_model(model, adapter.text_config(model.config))
    layers = adapter.text_config(model.config).num_hidden_layers
    lengths = sorted(len(e) for e in ordered) + [packed["input_ids"].shape[1] * 2 - sum(len(e) for e in ordered)]

    recorder = _Recorder(monkeypatch)
    with use_attention(lm, "mmtune_packed_sdpa"):
        _loss_and_grads(model, [packed])
    calls = recorder.language_calls("CLIPAttention")
    assert recorder.masks_built == 0
    assert calls and all(mask is None for *_, mask in calls)
    assert all(q[2] == k[2] for _, q, k, _ in calls)  # every call is one sample (or samples of one length)
    # c and d share a call only when short; otherwise one call per sample and layer
    scores = sum(q[0] * q[2] * k[2] for _, q, k, _ in calls)
    assert scores == layers * sum(n * n for n in lengths)
    assert sorted(q[2] for _, q, _, _ in calls for _ in range(q[0])) == sorted(lengths * layers)

    # The same check sees the block mask: one L x L call per layer over both rows, with a mask.
    recorder = _Recorder(monkeypatch)
    _loss_and_grads(model, [packed])
    calls = recorder.language_calls("CLIPAttention")
    width = packed["input_ids"].shape[1]
    assert recorder.masks_built == 1
    assert [(q[0], q[2], k[2]) for _, q, k, _ in calls] == [(2, width, width)] * layers
    assert all(mask is not None and mask.shape == (2, 1, width, width) for *_, mask in calls)


def test_the_mask_function_returns_sample_boundaries_and_keeps_other_patterns(family):
    from transformers.masking_utils import create_causal_mask

    register_packed_attention()
    adapter = _adapter(family)
    model = _model(adapter, "sdpa")
    config = copy.copy(adapter.text_config(model.config))
    config._attn_implementation = "mmtune_packed_sdpa"
    embeds = torch.zeros(2, 9, config.hidden_size)
    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    segments = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                                  position_ids=positions)
    assert isinstance(segments, PackedSegments)
    assert segments.lengths == ((3, 1, 2, 3), (6, 3)) and segments.groups[3] == [(0, 0), (0, 3), (1, 1)]
    # A padding mask, unpacked rows, and an overlay that opens a bidirectional block get the base mask.
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[0, :2] = 0
    mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=padding, cache=None,
                              position_ids=positions)
    assert isinstance(mask, torch.Tensor) and mask.shape == (2, 1, 9, 9)
    assert create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                              position_ids=torch.arange(9).expand(2, 9)) is None  # SDPA's is_causal, as stock
    blocks = torch.full((2, 9), -1)
    blocks[0, 4:6] = 7  # tokens 4 and 5 see each other
    mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                              position_ids=positions, block_sequence_ids=blocks)
    assert isinstance(mask, torch.Tensor) and bool(mask[0, 0, 4, 5])


def test_generation_with_padding_masks_is_unchanged():
    """Batched generation passes padding masks: the packed implementation hands those to the
    base kernel, so even with it switched on the tokens and scores stay the same."""
    adapter = _adapter("llava")
    model = _model(adapter, "sdpa").eval()
    lm = language_model(model, adapter.text_config(model.config))
    pad = adapter.tokenizer.pad_token_id
    ids = torch.tensor([[pad, pad, 5, 17, 30, 42], [7, 8, 9, 10, 11, 12]])
    mask = (ids != pad).long()
    settings = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
                    pad_token_id=pad)
    stock = model.generate(input_ids=ids, attention_mask=mask, **settings)
    with use_attention(lm, "mmtune_packed_sdpa"):
        switched = model.generate(input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(stock.sequences, switched.sequences)
    for a, b in zip(stock.scores, switched.scores):
        assert torch.equal(a, b)


# -- selection ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "per_sample"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_with_sdpa_or_eager_selects_per_sample(mode, attn):
    plan = resolve_attention(mode, batching="packing", attn_implementation=attn)
    assert plan.per_sample and plan.training_implementation == PACKED_IMPLEMENTATIONS[attn]
    assert plan.implementation == attn and "per sample" in plan.description


@pytest.mark.parametrize("batching", ["padding", "length_grouped", "token_budget"])
def test_unpacked_batches_keep_the_configured_kernel(batching):
    plan = resolve_attention("auto", batching=batching, attn_implementation="sdpa")
    assert not plan.per_sample and plan.training_implementation == "sdpa" and "padding masks" in plan.description


def test_flash_attention_keeps_its_varlen_path_and_off_keeps_the_block_mask():
    flash = resolve_attention("auto", batching="packing", attn_implementation="flash_attention_2")
    assert not flash.per_sample and "varlen" in flash.description
    off = resolve_attention("off", batching="packing", attn_implementation="sdpa")
    assert not off.per_sample and "block-diagonal" in off.description


def test_forcing_per_sample_where_it_cannot_work_says_what_to_change():
    with pytest.raises(ValueError, match="collator.batching=padding has no packed rows.*collator.batching=packing"):
        resolve_attention("per_sample", batching="padding", attn_implementation="sdpa")
    with pytest.raises(ValueError, match="flash_attention_2 already attends per sample"):
        resolve_attention("per_sample", batching="packing", attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="use one of auto, per_sample, off"):
        resolve_attention("fast", batching="packing", attn_implementation="sdpa")


def test_config_errors_are_listed_at_start_up(tmp_path, synthetic_dir, tiny_overrides):
    from mmtune.training.config import ConfigError, to_sft_config
    from mmtune.training.demo import compose_sft_config

    both = "loss_chunk_size=0.*\n.*training.packed_attention=per_sample cannot work here: collator.batching=padding"
    with pytest.raises(ConfigError, match=both):
        to_sft_config(compose_sft_config(tiny_overrides(tmp_path, synthetic_dir, "training.packed_attention=per_sample",
                                                        "collator.batching=padding", "training.loss_chunk_size=0")))


def test_models_that_cannot_switch_are_named(family):
    adapter = _adapter(family)
    model = _model(adapter, "sdpa")
    text_config = adapter.text_config(model.config)
    assert model_support_problem(model, text_config) == ""
    lm = language_model(model, text_config)
    lm._supports_attention_backend = False  # an instance attribute shadows the class's flag
    assert "AttentionInterface" in model_support_problem(model, text_config)
    del lm._supports_attention_backend
    text_config.sliding_window = 16
    try:
        assert "sliding_window=16" in model_support_problem(model, text_config)
    finally:
        text_config.sliding_window = None


# -- the training loop ----------------------------------------------------------------------------------


def _recipe(tmp_path, synthetic_dir, tiny_overrides, name, *extra):
    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    recipe = SFTRecipe(to_sft_config(compose_sft_config(tiny_overrides(
        tmp_path / name, synthetic_dir, "collator.batching=packing", "collator.batch_size=1",
        "collator.max_length=768", "training.max_steps=3", "training.max_grad_norm=null", *extra))))
    recipe.setup()
    return recipe


def test_the_loop_trains_per_sample_with_the_block_mask_losses_and_restores(tmp_path, synthetic_dir, tiny_overrides,
                                                                            capsys, monkeypatch):
    import json

    runs = {}
    for mode in ("auto", "off"):
        recipe = _recipe(tmp_path, synthetic_dir, tiny_overrides, mode, f"training.packed_attention={mode}")
        assert recipe.attention.per_sample == (mode == "auto")
        recorder = _Recorder(monkeypatch)
        recipe.train()
        runs[mode] = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        # the block mask is built only by the "off" run; packed rows reach the language model as samples
        assert (recorder.masks_built > 0) == (mode == "off")
        assert recipe.adapter.text_config(recipe.accelerator.unwrap_model(recipe.model).config)._attn_implementation \
            == "sdpa"
        recipe.cleanup()
    out = capsys.readouterr().out
    assert "attention: sdpa per sample over packed rows (mmtune_packed_sdpa, training.packed_attention=auto)" in out
    assert "attention: sdpa with transformers' block-diagonal" in out
    assert [m["step"] for m in runs["auto"]] == [1, 2, 3]
    for a, b in zip(runs["auto"], runs["off"]):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)


def test_the_loop_falls_back_on_auto_and_fails_on_per_sample_for_a_model_that_cannot_switch(
        tmp_path, synthetic_dir, tiny_overrides, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    monkeypatch.setattr(LlamaPreTrainedModel, "_supports_attention_backend", False)
    recipe = _recipe(tmp_path, synthetic_dir, tiny_overrides, "auto")
    assert not recipe.attention.per_sample and "per-sample attention unavailable" in recipe.attention.description
    recipe.cleanup()
    with pytest.raises(ValueError, match="per_sample cannot work with this model: LlamaModel does not call"):
        _recipe(tmp_path, synthetic_dir, tiny_overrides, "forced", "training.packed_attention=per_sample")


def test_plan_prints_what_the_attention_runs():
    from mmtune.training.plan import plan_run

    packed = plan_run(["experiment=demo", "collator.batching=packing"], num_gpus=1, skip_data=True)
    assert "  attention   sdpa per sample over packed rows" in packed.render()
    off = plan_run(["experiment=demo", "collator.batching=packing", "training.packed_attention=off"], num_gpus=1,
                   skip_data=True)
    assert "block-diagonal [B, 1, L, L] mask" in off.attention and "training.packed_attention=off" in off.attention


@pytest.mark.slow
def test_deepspeed_zero3_trains_per_sample_with_the_block_mask_losses(tmp_path, synthetic_dir, tiny_overrides):
    """One CPU process under ZeRO-3 (partitioned weights, DeepSpeed's engine around the model)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    runs = {}
    for mode in ("per_sample", "off"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = tmp_path / mode
        overrides = tiny_overrides(out, synthetic_dir, "collator.batching=packing", "collator.batch_size=1",
                                   "collator.max_length=768", "training.max_steps=3",
                                   f"training.packed_attention={mode}",
                                   "training.backend.engine=deepspeed", "training.backend.deepspeed.stage=3",
                                   f"training.backend.deepspeed.config_file={repo}/launch/deepspeed/zero3.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "RANK": "0",
               "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("dist_worker.py")),
                               str(tmp_path / f"{mode}.json"), *overrides], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[mode] = ([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], proc.stdout)
    assert "attention: sdpa per sample over packed rows" in runs["per_sample"][1]
    assert "attention: sdpa with transformers' block-diagonal" in runs["off"][1]
    assert [m["step"] for m in runs["per_sample"][0]] == [1, 2, 3]
    for a, b in zip(runs["per_sample"][0], runs["off"][0]):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)


def test_other_kernels_keep_transformers_mask_and_say_so():
    plan = resolve_attention("auto", batching="packing", attn_implementation="flex_attention")
    assert not plan.per_sample and "no per-sample variant of flex_attention" in plan.description
    with pytest.raises(ValueError, match="flex_attention has no per-sample variant: use model.attn_implementation"):
        resolve_attention("per_sample", batching="packing", attn_implementation="flex_attention")
