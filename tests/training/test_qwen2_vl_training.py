"""The qwen2_vl family trained by the SFT recipe on CPU with tiny random models: full and LoRA,
vision tower frozen or trained, the merger in its own LR group, gradient checkpointing and the
chunked loss (the same loss and gradients as without them), packed rows with per-sample
attention, recipes/sft.py end to end, ZeRO-3's vision call on a text-only batch and exact resume
after SIGKILL (both behind the slow marker)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmtune.models.config import ModelConfig
from mmtune.models.qwen2_vl import MODEL_TYPES
from mmtune.models.registry import build_adapter
from mmtune.training.config import to_sft_config
from mmtune.training.demo import compose_sft_config
from mmtune.training.loop import SFTRecipe
from tests.support.processes import kill_and_resume, read_jsonl, zero3_loss

REPO = Path(__file__).resolve().parents[2]
QWEN = ("model=qwen2_vl_tiny",)


@pytest.fixture
def make_recipe(tmp_path, synthetic_dir, tiny_overrides):
    made = []

    def make(*extra, name="run"):
        cfg = to_sft_config(compose_sft_config(tiny_overrides(tmp_path / name, synthetic_dir, *QWEN, *extra)))
        recipe = SFTRecipe(cfg)
        recipe.setup()
        made.append(recipe)
        return recipe

    yield make
    for recipe in made:
        recipe.cleanup()


def _params(recipe):
    return {n: p.detach().clone() for n, p in recipe.accelerator.unwrap_model(recipe.model).named_parameters()}


def _changed(before, after, part):
    return [n for n in before if part(n) and not torch.equal(before[n], after[n])]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_full_fine_tune_with_frozen_vision_and_the_merger_in_its_own_group(make_recipe, model_type):
    recipe = make_recipe(f"model.architecture.model_type={model_type}", "training.max_steps=2",
                         "training.vision.train=false", "training.projector.lr=1e-2", "training.lr=1e-3",
                         "training.warmup_ratio=0.0", "training.lr_scheduler=constant")
    assert recipe.adapter.family == "qwen2_vl" and recipe.adapter.model_type == model_type
    groups = {g["name"]: g for g in recipe.optim_groups}
    assert {round(g["lr"], 6) for name, g in groups.items() if name.startswith("projector")} == {1e-2}
    assert {round(g["lr"], 6) for name, g in groups.items() if name.startswith("language_model")} == {1e-3}
    assert not any(name.startswith("vision") for name in groups)
    before = _params(recipe)
    recipe.train()
    after = _params(recipe)
    merger = lambda n: ".visual.merger." in n  # noqa: E731
    tower = lambda n: ".visual." in n and not merger(n)  # noqa: E731
    assert _changed(before, after, merger) and _changed(before, after, lambda n: ".language_model." in n)
    assert not _changed(before, after, tower)


def test_training_the_vision_tower_updates_it(make_recipe):
    recipe = make_recipe("training.max_steps=2", "training.vision.train=true", "training.lr=1e-3")
    before = _params(recipe)
    recipe.train()
    after = _params(recipe)
    assert _changed(before, after, lambda n: ".visual.blocks." in n)


def test_lora_trains_the_language_model_adapters_and_saves_a_loadable_merged_checkpoint(make_recipe):
    recipe = make_recipe("peft=lora", "peft.r=4", "training.max_steps=2", "training.lr=1e-2",
                         "training.vision.train=false")
    trainable = [n for n, p in recipe.model.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable)
    assert all(("lora_" in n and ".language_model." in n) or ".visual.merger." in n for n in trainable)
    recipe.train()
    final = recipe.save()
    assert (final / "adapter" / "adapter_config.json").is_file()
    merged = build_adapter(ModelConfig(family="qwen2_vl", path=str(final))).load_model().eval()
    peft_model = recipe.accelerator.unwrap_model(recipe.model).eval()
    ids = torch.randint(5, 200, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft_model(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("batching", ["padding", "packing"])
def test_checkpointing_and_the_chunked_loss_give_the_materialised_loss_and_gradients(make_recipe, batching):
    """The first micro-batch's loss and gradients through the loop's own ``batch_loss``: chunked
    with gradient checkpointing (and per-sample attention over packed rows) equal plain
    materialised logits."""
    extra = ("training.max_steps=1", f"collator.batching={batching}", "collator.max_length=512")
    results = {}
    for name, settings in (("plain", ("training.loss_impl=materialized", "training.packed_attention=off")),
                           ("fast", ("training.loss_impl=chunked", "training.loss_chunk_size=16",
                                     "training.gradient_checkpointing=true"))):
        recipe = make_recipe(*extra, *settings, name=name)
        if name == "fast" and batching == "packing":
            assert recipe.attention.per_sample
        batch, _ = next(iter(recipe.data.dataloader(0)))
        assert batch["position_ids"].shape[0] == 4 and batch["image_grid_thw"] is not None
        recipe.model.train()
        with recipe._training_attention():
            loss = recipe.batch_loss(batch)
            loss.backward()
        grads = {n: p.grad.clone() for n, p in recipe.model.named_parameters() if p.grad is not None}
        results[name] = float(loss.detach()), grads
    (loss_a, grads_a), (loss_b, grads_b) = results["plain"], results["fast"]
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    assert grads_a.keys() == grads_b.keys() and any(".visual.merger." in n for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_sft_recipe_trains_generates_and_saves_the_tiny_qwen(tmp_path):
    """``python recipes/sft.py experiment=demo_single_image model=qwen2_vl_tiny`` (what the model
    config's header says), with evaluation after training: final/ loads back through the adapter."""
    from mmtune.data.synthetic import generate_synthetic

    data = tmp_path / "data"
    generate_synthetic(data, n_train=12, n_test=2, n_llava=0, seed=0, image_size=56)
    out = tmp_path / "run"
    overrides = ["experiment=demo_single_image", "model=qwen2_vl_tiny", "model.architecture.model_type=qwen2_5_vl",
                 f"training.output_dir={out}", f"synthetic.out_dir={data}", "synthetic.n_train=12",
                 "synthetic.n_test=2", "training.max_steps=3", "training.eval_before=false",
                 "training.eval_after=true", "logging.progress_bar=false", "collator.batch_size=4",
                 "eval.generation.max_new_tokens=3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "sft.py"), *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["train/loss"] > 0 for m in metrics)
    run = json.loads((out / "final" / "mmtune_run.json").read_text())
    assert run["family"] == "qwen2_vl"
    generations = (out / "eval" / "after" / "generations" / "synthetic.jsonl").read_text().splitlines()
    assert generations and all(json.loads(line)["answer"] is not None for line in generations)
    adapter = build_adapter(ModelConfig(family="qwen2_vl", path=str(out / "final")))
    assert adapter.model_type == "qwen2_5_vl"
    adapter.load_model()


# -- slow: ZeRO-3 on one CPU process, exact resume --------------------------------------------------


@pytest.mark.slow
def test_zero3_runs_the_vision_tower_on_a_text_only_batch(tmp_path, tiny_overrides):
    """Under ZeRO-3 every rank must call the same modules: a text-only batch still runs the vision
    tower and merger (``vision_dummy_loss``), which adds exactly 0 and gives their gathered
    parameters zero, not missing, gradients."""
    data = tmp_path / "text.json"
    data.write_text(json.dumps([{"id": f"t{i}", "conversations": [
        {"from": "human", "value": f"Say {i} please"}, {"from": "gpt", "value": f"{i} then"}]} for i in range(8)]))
    results = {}
    for impl in ("chunked", "materialized"):
        overrides = tiny_overrides(tmp_path / impl, tmp_path / "syn", *QWEN, f"training.loss_impl={impl}",
                                   "training.loss_chunk_size=16", "synthetic.enabled=false",
                                   "data.mixture.sources.0.format=llava", f"data.mixture.sources.0.path={data}",
                                   "data.mixture.sources.0.image_root=null", "training.vision.train=true",
                                   "training.backend.engine=deepspeed", "training.backend.deepspeed.stage=3",
                                   f"training.backend.deepspeed.config_file={REPO}/launch/deepspeed/zero3.json")
        results[impl] = zero3_loss(tmp_path / f"{impl}.pt", overrides)
    chunked, materialized = results["chunked"], results["materialized"]
    assert chunked["loss"] == pytest.approx(materialized["loss"], rel=1e-6)
    vision = [n for n in chunked["grads"] if ".visual." in n]
    assert any(".visual.blocks." in n for n in vision) and any(".visual.merger." in n for n in vision)
    for name in vision:
        assert chunked["grads"][name] is not None, name
        assert torch.count_nonzero(chunked["grads"][name]) == 0, name
    for name, grad in materialized["grads"].items():
        if grad is not None:
            torch.testing.assert_close(chunked["grads"][name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_sigkill_then_resume_of_packed_qwen_rows_matches_the_uninterrupted_run(tmp_path, synthetic_dir,
                                                                              tiny_overrides):
    common = (*QWEN, "training.epochs=2", "training.save_every_steps=3", "training.log_sample_ids=true",
              "training.save_final=false", "training.resume=auto", "training.lr=3e-3", "collator.batching=packing",
              "collator.batch_size=1", "collator.max_length=256", "collator.packing_window=8",
              "training.gradient_accumulation_steps=2")
    run = kill_and_resume(tmp_path, synthetic_dir, tiny_overrides, common)
    resume_step = run.resume_step
    assert resume_step >= 3
    ids, metrics = read_jsonl(run.killed_dir / "sample_ids.jsonl"), read_jsonl(run.killed_dir / "metrics.jsonl")
    ref_ids, ref_metrics = read_jsonl(run.reference_dir / "sample_ids.jsonl"), read_jsonl(
        run.reference_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics] == list(range(1, len(ref_metrics) + 1))
    ref_loss = {m["step"]: m["train/loss"] for m in ref_metrics}
    after = [(m["step"], m["train/loss"]) for m in metrics if m["step"] > resume_step]
    assert after and after == [(step, ref_loss[step]) for step, _ in after]
    assert ids == ref_ids


def test_a_sample_with_an_image_the_processor_refuses_is_left_out_and_reported(make_recipe, tmp_path):
    from PIL import Image as PILImage

    images = tmp_path / "images"
    images.mkdir()
    PILImage.effect_noise((80, 60), 40).convert("RGB").save(images / "ok.png")
    PILImage.new("RGB", (4, 1000), (1, 2, 3)).save(images / "strip.png")  # aspect ratio 250: refused
    records = [{"id": f"r{i}", "image": "strip.png" if i == 3 else "ok.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "noise"}]} for i in range(6)]
    data = tmp_path / "llava.json"
    data.write_text(json.dumps(records))
    source = ("synthetic.enabled=false", "data.mixture.sources.0.format=llava", f"data.mixture.sources.0.path={data}",
              f"data.mixture.sources.0.image_root={images}", "training.max_steps=1")
    with pytest.raises(ValueError, match=r"strip\.png.*'r3', turn 1 \(question\).*aspect ratio"):
        make_recipe(*source, "data.validation.mode=strict", name="strict")
    recipe = make_recipe(*source, "data.validation.mode=skip", name="skip")
    (loss,) = recipe.data.loss_report.sources
    assert loss.refused_images == 1 and loss.no_window == 0 and "r3: " in loss.refused_examples[0]
    assert recipe.data.loss_report.trainable_samples == 5
    assert "1 samples left out for an image that cannot be used" in recipe.data.loss_report.render()
    report = json.loads((recipe.output_dir / "data_report.json").read_text())
    assert report["sources"][0]["refused_images"] == 1
    recipe.train()
