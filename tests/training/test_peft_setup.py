"""LoRA on the language model only, merged export loadable as a plain model, QLoRA's clear error."""

import importlib.util

import pytest
import torch

from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from mmtune.training.config import PeftConfig, to_sft_config
from mmtune.training.demo import compose_sft_config
from mmtune.training.loop import SFTRecipe
from mmtune.training.peft_setup import lora_target_names, qlora_load_kwargs


def test_lora_targets_stay_inside_the_language_model():
    adapter = build_adapter(ModelConfig(family="llava"))
    model = adapter.load_model()
    names = lora_target_names(model, adapter.module_groups(model), ["q_proj", "v_proj"])
    assert names and all(".language_model." in n for n in names)
    # CLIP has q_proj/v_proj too; none of them may be picked.
    assert any(".vision_tower." in n and n.endswith("q_proj") for n, _ in model.named_modules())
    with pytest.raises(ValueError, match="matched no linear layer"):
        lora_target_names(model, adapter.module_groups(model), ["qkv"])


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_qlora_without_bitsandbytes_says_how_to_fix():
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        qlora_load_kwargs(PeftConfig(method="qlora"), torch.bfloat16)


def test_lora_run_saves_adapter_and_a_loadable_merged_checkpoint(tmp_path, synthetic_dir, tiny_overrides):
    cfg = to_sft_config(compose_sft_config(tiny_overrides(
        tmp_path / "run", synthetic_dir, "peft=lora", "peft.r=4", "training.max_steps=3", "training.lr=1e-2",
        "training.vision.train=false", "training.projector.lr=1e-3")))
    recipe = SFTRecipe(cfg)
    recipe.setup()
    trainable = [n for n, p in recipe.model.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable)
    assert all("lora_" in n or ".multi_modal_projector." in n for n in trainable)
    recipe.train()
    final = recipe.save()
    recipe.cleanup()
    assert (final / "adapter" / "adapter_config.json").is_file()
    assert (final / "adapter" / "non_lora_trainables.safetensors").is_file()
    # The merged checkpoint loads through the adapter like any model and matches the LoRA model.
    merged = build_adapter(ModelConfig(family="llava", path=str(final))).load_model().eval()
    peft_model = recipe.accelerator.unwrap_model(recipe.model).eval()
    ids = torch.randint(5, 200, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft_model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert not any("lora_" in n for n, _ in merged.named_parameters())


@pytest.mark.parametrize("family, architecture", [("llava", {}), ("qwen2_vl", {"model_type": "qwen2_vl"}),
                                                  ("qwen2_vl", {"model_type": "qwen3_vl"})])
def test_qlora_keeps_the_vision_tower_projector_and_head_in_full_precision(family, architecture):
    """The adapter's skip patterns, read the way transformers' quantizer reads
    ``llm_int8_skip_modules``: every linear layer of the vision tower, the projector and the
    output head stays unquantized, every one of the language model is quantized."""
    from torch import nn
    from transformers.quantizers.quantizers_utils import should_convert_module

    adapter = build_adapter(ModelConfig(family=family, architecture=architecture))
    model = adapter.load_model()
    groups = adapter.module_groups(model)
    patterns = adapter.quantization_skip_modules()
    kept = {id(m) for part in (groups.vision, groups.projector) for root in part for m in root.modules()}
    head = model.get_output_embeddings()
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert any(id(m) in kept for _, m in linear)
    for name, module in linear:
        full_precision = id(module) in kept or module is head
        assert should_convert_module(name, patterns) is not full_precision, name
