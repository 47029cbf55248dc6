"""The ``auto`` family's tested classes trained by the SFT recipe on CPU (tiny random-weight
checkpoints of every class of ``mmtune.testing.checkpoints.KINDS``, built from transformers' classes, ``configs/model/<class>_tiny.yaml``): a few steps of full fine-tuning
with the vision tower frozen, and of LoRA with the vision tower trained; what should change
changes and nothing else. One mode per class runs by default, the other behind ``slow``."""

import pytest
import torch

from mmtune.training.config import to_sft_config
from mmtune.training.demo import compose_sft_config
from mmtune.training.loop import SFTRecipe
from tests.support.auto_checkpoints import CLASSES, GAPS, adapter, checkpoint

# the mode each class runs in the default suite (the other one is behind the slow marker)
DEFAULT_MODE = {kind: ("full", "lora")[k % 2] for k, kind in enumerate(CLASSES)}
SFT_GAPS = GAPS.get("sft", {})
#: classes whose fused expert weights peft puts LoRA on (as parameters, which take no dropout): start-up
#: refuses the default dropout there (test_lora_on_fused_experts_refuses_dropout_naming_the_setting)
LORA_WITHOUT_DROPOUT = {"glm4v_moe"}  # keyed by case id, "<class>-<mode>"
CASES = [pytest.param(kind, mode, id=f"{kind}-{mode}",
                      marks=([] if DEFAULT_MODE[kind] == mode else [pytest.mark.slow])
                      + ([pytest.mark.xfail(strict=True, reason=SFT_GAPS[f"{kind}-{mode}"])]
                         if f"{kind}-{mode}" in SFT_GAPS else []))
         for kind in CLASSES for mode in ("full", "lora")]


def _batching(kind):
    """Padding for a model with layers packed rows are refused for (linear attention ...), or one whose
    adapter refuses packing, else the demo's."""
    from mmtune.models.masks import unpackable_layer_types

    auto = adapter(kind)
    refused = unpackable_layer_types(auto.text_config(auto.model_config)) or auto.packing_problem
    return ["collator.batching=padding"] if refused else []


def _params(recipe):
    return {n: p.detach().clone() for n, p in recipe.accelerator.unwrap_model(recipe.model).named_parameters()}


def _names(recipe, group):
    """Parameter names of one module group (vision, projector, language_model, frozen) of the unwrapped model."""
    model = recipe.accelerator.unwrap_model(recipe.model)
    ids = {id(p) for module in getattr(recipe.adapter.module_groups(model), group) for p in module.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("kind, mode", CASES)
def test_a_few_steps_train_what_the_config_says(kind, mode, tmp_path, synthetic_dir, tiny_overrides):
    settings = (["training.vision.train=false", "training.lr=1e-3"] if mode == "full" else
                ["peft=lora", "peft.r=4", "training.vision.train=true", "training.lr=1e-2",
                 *(["peft.dropout=0.0"] if kind in LORA_WITHOUT_DROPOUT else [])])
    overrides = tiny_overrides(tmp_path / "run", synthetic_dir, f"model={kind}_tiny", f"model.path={checkpoint(kind)}",
                               "training.max_steps=2", "training.warmup_ratio=0.0", "training.lr_scheduler=constant",
                               "collator.max_length=1024", *_batching(kind), *settings)
    recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
    recipe.setup()
    try:
        assert recipe.adapter.family == "auto"
        vision, language = _names(recipe, "vision"), _names(recipe, "language_model")
        projector, frozen = _names(recipe, "projector"), _names(recipe, "frozen")
        assert vision and language
        # every parameter is in exactly one group (LLaVA-OneVision's image_newline with the projector)
        every = vision | projector | language | frozen
        assert len(vision) + len(projector) + len(language) + len(frozen) == len(every) == len(_params(recipe))
        model = recipe.accelerator.unwrap_model(recipe.model)
        assert not any(p.requires_grad for n, p in model.named_parameters() if n in frozen)
        before = _params(recipe)
        recipe.train()
        after = _params(recipe)
    finally:
        recipe.cleanup()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert not changed & frozen, "modules image-text training does not run (Janus's image generation) stay as they were"
    if mode == "full":
        assert changed & language, "the language model trains"
        assert not changed & vision, "the frozen vision tower stays as it was"
        assert projector <= changed, "the whole projector trains"
    else:
        lora = {n for n in changed if "lora_" in n}
        assert lora, "the LoRA adapters train"
        assert changed & vision, "the vision tower trains"
        base_language = {n for n in language if "lora_" not in n and "base_layer" in n}
        assert not changed & base_language, "the language model's own weights stay frozen under LoRA"


def test_packing_is_refused_at_start_up_for_a_model_that_refuses_the_packed_position_layout(
        tmp_path, synthetic_dir, tiny_overrides):
    """HunYuan-VL (transformers 5.25) reads packed boundaries from a running-position row, then refuses
    that layout: its adapter says so, batches get its four position rows alone, and packing stops at
    start-up naming the reason and the setting that works."""
    auto = adapter("hunyuan_vl")
    assert "HunYuanVLTextModel refuses position ids laid out [1 + 4, B, L]" in auto.packing_problem
    assert adapter("qwen3_vl_moe").packing_problem == ""  # an M-RoPE model that takes the layout
    overrides = tiny_overrides(tmp_path / "run", synthetic_dir, "model=hunyuan_vl_tiny",
                               f"model.path={checkpoint('hunyuan_vl')}", "training.max_steps=1",
                               "collator.max_length=1024", "collator.batching=packing")
    recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
    with pytest.raises(ValueError, match=r"collator.batching=packing cannot work with this model: HunYuanVLTextModel"
                                         r".*collator.batching=padding"):
        recipe.setup()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
@pytest.mark.parametrize("kind", ["qwen3_vl_moe", "qwen3_5_moe", "qwen4_exp", "kimi_k25", "glm4v_moe"])
def test_moe_classes_train_on_two_ranks(kind, engine, tmp_path, synthetic_dir, tiny_overrides):
    """The MoE classes (experts in every layer) through the SFT recipe on 2 gloo ranks under DDP and
    FSDP2, LoRA on the default targets: finite losses, a final checkpoint."""
    import math

    from tests.support.processes import read_jsonl, run_ok, torchrun

    run = tmp_path / "run"
    run_ok([*torchrun(2), *tiny_overrides(run, synthetic_dir, f"model={kind}_tiny", f"model.path={checkpoint(kind)}",
                                          "training.max_steps=2", "peft=lora", "peft.dropout=0.0",
                                          "collator.max_length=1024", *_batching(kind),
                                          f"training.backend.engine={engine}")])
    losses = [m["train/loss"] for m in read_jsonl(run / "metrics.jsonl") if "train/loss" in m]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert (run / "final").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_janus_trains_in_full_on_two_ranks(engine, tmp_path, synthetic_dir, tiny_overrides):
    """Janus's image-generation modules (frozen: an image-text step never runs them) hold no gradient
    DDP or FSDP2 waits for: full training on 2 gloo ranks gives finite losses (DDP stopped with
    "Expected to have finished reduction" while they were trained with the projector)."""
    import math

    from tests.support.processes import read_jsonl, run_ok, torchrun

    run = tmp_path / "run"
    run_ok([*torchrun(2), *tiny_overrides(run, synthetic_dir, "model=janus_tiny", f"model.path={checkpoint('janus')}",
                                          "training.max_steps=2", "training.vision.train=false",
                                          "collator.max_length=1024", f"training.backend.engine={engine}")])
    losses = [m["train/loss"] for m in read_jsonl(run / "metrics.jsonl") if "train/loss" in m]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_lora_on_fused_experts_refuses_dropout_naming_the_setting(tmp_path, synthetic_dir, tiny_overrides):
    """GLM-4.5V's experts hold their weights as parameters; peft wraps them without dropout, so the
    default ``peft.dropout`` stops at start-up with the setting to change, not peft's bare error."""
    overrides = tiny_overrides(tmp_path / "run", synthetic_dir, "model=glm4v_moe_tiny",
                               f"model.path={checkpoint('glm4v_moe')}", "training.max_steps=1", "peft=lora")
    recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
    with pytest.raises(ValueError, match=r"peft.dropout=0.05: peft puts LoRA on this model's fused expert weights.*"
                                         r"set peft.dropout=0.0"):
        recipe.setup()
