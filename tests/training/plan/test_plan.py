"""`mmtune plan` on every Table 3 / Table 5 experiment against generated stand-in data.

The stand-in tree mirrors the real layout under $MMTUNE_DATA_ROOT (MMDU-45k, llava-665k,
MMDU benchmark, MM-Vet) with the synthetic generator's files, and stand-in checkpoint
directories hold only a config.json: plan never reads weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from mmtune.training import plan as plan_mod
from mmtune.models.internlm_xcomposer2 import InternLMXComposer2Adapter
from mmtune.models.llava import LlavaAdapter
from mmtune.training.plan import (
    GPU_TYPES,
    ParamCounts,
    PlanError,
    estimate_cost,
    main,
    plan_evaluation,
    plan_run,
)

REPO = Path(__file__).resolve().parents[3]
EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "experiment").glob("table[35]_*.yaml"))


def _recipe(name: str) -> str:
    # The file's command (the first line after the package header) names its recipe.
    command = (REPO / "configs" / "experiment" / f"{name}.yaml").read_text().splitlines()[1]
    assert "recipes/" in command, f"{name}.yaml does not start with the command that runs it"
    return "evaluate" if "recipes/evaluate.py" in command else "sft"


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    from mmtune.data.synthetic import generate_synthetic
    from mmtune.models import internlm_xcomposer2 as xc2
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("standin")
    syn = generate_synthetic(root / "synthetic", n_train=12, n_test=4, n_llava=12, image_size=16)
    data = root / "data"
    (data / "mmdu").mkdir(parents=True)
    (data / "llava").mkdir()
    links = {
        data / "mmdu" / "mmdu-45k.json": syn.train_json,
        data / "mmdu" / "mmdu-45k_pics": syn.image_dir,
        data / "mmdu" / "benchmark.json": syn.test_json,
        data / "mmdu" / "mmdu_pics": os.path.join(syn.image_dir, "mmdu_pics"),
        data / "llava" / "llava_v1_5_mix665k.json": syn.llava_json,
        data / "llava" / "synthetic": os.path.join(syn.image_dir, "synthetic"),
    }
    for link, target in links.items():
        if os.path.isdir(target):  # image folders: real copies (a symlink out of the image root is refused)
            shutil.copytree(target, link)
        else:
            link.symlink_to(target)
    mmvet = data / "mm-vet"
    (mmvet / "images").mkdir(parents=True)
    items = {}
    for i, png in enumerate(sorted(Path(syn.image_dir, "mmdu_pics").glob("*.png"))[:3]):
        shutil.copy(png, mmvet / "images" / png.name)
        items[f"v1_{i}"] = {"imagename": png.name, "question": "What color?", "answer": "red", "capability": ["rec"]}
    (mmvet / "mm-vet.json").write_text(json.dumps(items))

    # Checkpoints: only config.json (the stage-1 LLaVA for "add to the pool", and the
    # final/ directories the *_eval rows evaluate).
    llava = AutoConfig.for_model(**LlavaAdapter.known_architectures["llava-hf/llava-1.5-7b-hf"])
    stage1 = root / "ckpt" / "llava-v1.5-7b-pretrain-hf"
    stage1.mkdir(parents=True)
    llava.to_json_file(str(stage1 / "config.json"))
    xc2_config = xc2.native_config_from_official(InternLMXComposer2Adapter.known_architectures["internlm/internlm-xcomposer2-vl-7b"],
                                                 image_size=490, plora_r=256)
    for run in ("table3_llava15_7b_mmdu45k", "table5_mmdu45k_8k", "table5_sft_continue", "table5_sft_pool",
                "table3_xc2_mmdu45k"):
        final = root / "outputs" / run / "final"
        final.mkdir(parents=True)
        (xc2_config if "xc2" in run else llava).to_json_file(str(final / "config.json"))
    return root


@pytest.fixture
def env(standin: Path, monkeypatch):
    monkeypatch.setenv("MMTUNE_DATA_ROOT", str(standin / "data"))
    monkeypatch.setenv("MMTUNE_CKPT_ROOT", str(standin / "ckpt"))
    monkeypatch.setenv("MMTUNE_OUTPUT_ROOT", str(standin / "outputs"))
    monkeypatch.setenv("MMTUNE_CACHE_DIR", str(standin / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)
    return standin


def test_every_table_row_has_an_experiment():
    assert len(EXPERIMENTS) >= 16
    assert {_recipe(e) for e in EXPERIMENTS} == {"sft", "evaluate"}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_plan_every_experiment(env, experiment: str):
    if _recipe(experiment) == "sft":
        p = plan_run([f"experiment={experiment}"], num_gpus=8, gpu="a100-80g",
                     accelerate_config="launch/accelerate/single_node_8gpu_zero3.yaml")
        assert p.run_name == experiment
        assert p.data["samples_per_epoch"] > 0 and p.data["tokens_per_epoch"] > 0
        assert all(s["kept"] == s["records"] > 0 for s in p.data["sources"])
        assert p.cost["optimizer_steps"] >= 1 and p.cost["gpu_hours"] > 0
        assert p.zero["stage"] == 3
        assert p.peft["method"] == "lora" and p.params["lora"] > 0
        assert p.params["trainable"] < 0.1 * p.params["total"]
        if "xc2" in experiment:
            assert 8.6e9 < p.params["total"] - p.params["lora"] < 8.75e9  # InternLM-XC2-VL: 8.67B
            assert p.context["factor"] == 1.0  # 16k within its 32k positions: no interpolation
        else:
            assert 7.0e9 < p.params["total"] - p.params["lora"] < 7.1e9  # LLaVA-1.5-7B: 7.06B
            assert p.context["factor"] == 2.0 and p.context["rope_scaling"] == "linear"
        text = p.render()
        assert "optimizer steps" in text and "GiB" in text and "ZeRO stage 3" in text
    else:
        p = plan_evaluation([f"experiment={experiment}"], gpu="a100-80g")
        assert p.run_name == experiment
        mmdu = next(b for b in p.benchmarks if b["name"] == "mmdu")
        assert mmdu["items"] == 4 and mmdu["judge_calls"] == mmdu["answers"] > 0
        assert p.memory_gib["weights"] > 12 and p.fits
        assert "judge calls" in p.render()


def test_training_estimate_matches_the_stated_formula():
    params = ParamCounts(total=1000, vision=100, projector=10, language_model=890, trainable=110,
                         trainable_language_model=100, lora=100, hidden_size=8, num_layers=2, vocab_size=32,
                         image_tokens=4, source="test")
    gpu = GPU_TYPES["h100"]
    cost = estimate_cost(params, train_tokens=1000, train_images=10, mean_sample_tokens=50, micro_batch_tokens=64,
                         optimizer_steps=3, weight_dtype="bfloat16", gradient_checkpointing=True, zero_stage=2,
                         offload_optimizer=False, offload_params=False, num_gpus=4, gpu=gpu, utilization=0.5)
    per_token = 4 * 890 + 2 * 100 + 2 * 890 + 6 * 2 * 8 * 50 * 4 / 3
    flops = 1000 * per_token + 2 * 100 * 4 * 10
    assert cost.flops == pytest.approx(flops)
    assert cost.gpu_hours == pytest.approx(flops / (989e12 * 0.5) / 3600)
    gib = 1024**3
    assert cost.memory_gib["weights"] == pytest.approx(2 * 1000 / gib)  # ZeRO-2 keeps full weights
    assert cost.memory_gib["gradients"] == pytest.approx(2 * 110 / 4 / gib)
    assert cost.memory_gib["optimizer"] == pytest.approx(12 * 110 / 4 / gib)
    assert cost.memory_gib["activations"] == pytest.approx((2 * 64 * 8 * 2 + 34 * 64 * 8) / gib)
    assert cost.memory_gib["logits"] == pytest.approx(14 * 64 * 32 / gib)  # materialised by default


def test_missing_images_fail_early_with_the_report(env, tmp_path, capsys):
    # A copy of MMDU-45k whose second record names an image that does not exist.
    records = json.loads((env / "data" / "mmdu" / "mmdu-45k.json").read_text())
    records[1]["image"][0] = "no-such-image.png"
    broken = tmp_path / "mmdu-45k.json"
    broken.write_text(json.dumps(records))
    rc = main(["experiment=table5_mmdu45k_8k", f"data.mixture.sources.0.path={broken}"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "CANNOT START" in err and "missing_image" in err and records[1]["id"] in err
    assert main(["experiment=table5_mmdu45k_8k", f"data.mixture.sources.0.path={broken}", "--allow-skipped"]) == 0
    out = capsys.readouterr().out
    assert "skips 1 record(s)" in out and "missing_image" in out
    assert f"kept {len(records) - 1:>9,} of {len(records):>9,}" in out


def test_missing_data_file_names_the_source(env):
    with pytest.raises(PlanError, match="mmdu_45k.*does not exist"):
        plan_run(["experiment=table5_mmdu45k_8k", "data.mixture.sources.0.path=/nope/mmdu-45k.json"])


def test_sweep_list_and_plan(env, capsys, tmp_path):
    assert main(["--sweep", "launch/sweeps/table5.yaml", "--list"]) == 0
    assert capsys.readouterr().out.split("\n")[:3] == [
        "experiment=table5_mmdu45k_8k", "experiment=table5_sft_continue", "experiment=table5_sft_pool"]
    out_json = tmp_path / "plans.json"
    assert main(["--sweep", "launch/sweeps/table5.yaml", "--gpu", "h100", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert out.count("== run ") == 3 and "3 runs planned, 0 cannot start" in out
    plans = json.loads(out_json.read_text())
    assert [p["run_name"] for p in plans] == ["table5_mmdu45k_8k", "table5_sft_continue", "table5_sft_pool"]
    # The sweep's accelerate config decides the ZeRO stage.
    assert all(p["zero"]["stage"] == 3 for p in plans)
    assert main(["--sweep", "launch/sweeps/table5_eval.yaml"]) == 0
    assert capsys.readouterr().out.count("== evaluation ") == 7


def test_tiny_model_counts_exactly(env):
    # The random-weight tiny LLaVA: counts from the meta-device build equal a real build.
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    model_cfg = ModelConfig(family="llava", path=None, architecture={"text_config": {"vocab_size": 512}})
    real = build_adapter(model_cfg).load_model()
    args = argparse.Namespace
    counts = plan_mod.count_parameters(model_cfg, args(method="none", r=0, target_modules=None),
                                       args(vision=args(train=False), projector=args(train=True),
                                            language_model=args(train=True)))
    assert counts.total == sum(p.numel() for p in real.parameters())
    assert counts.vision == sum(p.numel() for p in real.model.vision_tower.parameters())
    assert counts.trainable == counts.total - counts.vision


def test_cli_plans_an_evaluation_row_as_an_evaluation(env, capsys):
    # The experiment's own command line (recipes/evaluate.py) decides, without --recipe.
    assert plan_mod.experiment_recipe(["experiment=table5_baseline_2k"]) == "evaluate"
    assert plan_mod.experiment_recipe(["experiment=table5_mmdu45k_8k", "training.lr=1e-4"]) == "sft"
    assert main(["experiment=table5_baseline_2k"]) == 0
    out = capsys.readouterr().out
    assert "== evaluation table5_baseline_2k" in out and "window      2048" in out


def test_plan_counts_steps_as_the_training_loop(tmp_path, synthetic_dir, tiny_overrides):
    # Padded batches make the plan's micro-batch count exact, so the step counts must agree.
    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    extra = ("collator.batch_size=3", "training.gradient_accumulation_steps=4", "training.epochs=3")
    overrides = tiny_overrides(tmp_path / "run", synthetic_dir, *extra)
    planned = plan_run(overrides, num_gpus=1, gpu="h100")
    recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
    recipe.setup()
    # 32 samples in batches of 3: 11 micro-batches, 3 steps of 4 per epoch (the last one partial).
    assert recipe.steps_per_epoch == [3, 3, 3]
    assert planned.cost["optimizer_steps"] == recipe.total_steps == 9
    recipe.cleanup()


def test_logits_term_follows_the_loss_implementation():
    params = ParamCounts(total=7_000_000_000, vision=300_000_000, projector=20_000_000, language_model=6_700_000_000,
                         trainable=6_700_000_000, trainable_language_model=6_700_000_000, lora=0, hidden_size=4096,
                         num_layers=32, vocab_size=92544, image_tokens=576, source="test")
    common = dict(train_tokens=10**6, train_images=10, mean_sample_tokens=4000, micro_batch_tokens=8192,
                  optimizer_steps=10, weight_dtype="bfloat16", gradient_checkpointing=True, zero_stage=3,
                  offload_optimizer=False, offload_params=False, num_gpus=8, gpu=GPU_TYPES["a100-80g"],
                  utilization=0.35)
    gib = 1024**3
    s, V, d = 8192, 92544, 4096
    terms = {impl: estimate_cost(params, loss_impl=impl, loss_chunk_size=1024, **common)
             for impl in ("materialized", "chunked", "fused")}
    assert terms["materialized"].memory_gib["logits"] == pytest.approx(14 * s * V / gib)
    assert terms["chunked"].memory_gib["logits"] == pytest.approx((6 * 1024 * V + 2 * s * d + 2 * V * d + 4 * V * d) / gib)
    # Liger's chunk: 8192 rows / ceil(92544 / 4096) = 23 -> 357 -> next power of two 512
    assert terms["fused"].memory_gib["logits"] == pytest.approx((2 * 512 * V + 2 * s * d + 4 * V * d) / gib)
    assert terms["chunked"].memory_gib["logits"] < 0.35 * terms["materialized"].memory_gib["logits"]
    assert "training.loss_impl=chunked" in terms["chunked"].formula
    frozen_head = estimate_cost(params, loss_impl="chunked", loss_chunk_size=1024, head_trains=False, **common)
    assert frozen_head.memory_gib["logits"] == pytest.approx((6 * 1024 * V + 2 * s * d) / gib)


def test_evaluation_plan_on_several_gpus_and_with_a_served_model(env):
    experiment = next(e for e in EXPERIMENTS if _recipe(e) == "evaluate" and "mmdu" in e)
    one = plan_evaluation([f"experiment={experiment}"], gpu="a100-80g", num_gpus=1)
    many = plan_evaluation([f"experiment={experiment}"], gpu="a100-80g", num_gpus=8)
    mmdu = {p.gpus: next(e for e in p.generation if e["benchmark"] == "mmdu") for p in (one, many)}
    items = next(b for b in many.benchmarks if b["name"] == "mmdu")["items"]
    assert mmdu[1]["gpus"] == 1 and mmdu[1]["hours_wall"] == pytest.approx(mmdu[1]["hours"])
    assert mmdu[8]["gpus"] == min(8, items) and mmdu[8]["hours_wall"] < mmdu[1]["hours"]
    assert mmdu[8]["hours"] == mmdu[1]["hours"]  # the one-GPU figure stays beside it
    assert f"on {min(8, items)} GPUs: <=" in many.render() and "on 1 GPUs" not in one.render()
    served = plan_evaluation([f"experiment={experiment}", "eval.generation.backend=api",
                              "eval.generation.api.model=gpt-4o-2024-05-13"], gpu="a100-80g", num_gpus=8)
    assert served.served_model == "gpt-4o-2024-05-13" and served.generation == [] and served.params is None
    assert "served model 'gpt-4o-2024-05-13'" in served.render() and "judge calls" in served.render()


def test_a_run_is_planned_for_its_experiments_own_launcher(env):
    """`mmtune plan experiment=X` plans the README's ZeRO-3 command of X, and says so."""
    own = plan_run(["experiment=table3_llava15_7b_mmdu45k"], num_gpus=None)
    given = plan_run(["experiment=table3_llava15_7b_mmdu45k"], num_gpus=8,
                     accelerate_config="launch/accelerate/single_node_8gpu_zero3.yaml")
    assert own.zero["stage"] == 3 and own.zero["num_gpus"] == 8  # num_processes of the launcher
    assert "the launcher of the experiment's own command" in own.zero["origin"]
    assert own.cost["memory_gib"] == given.cost["memory_gib"]
    # an experiment whose command names no launcher: plain DDP, said to be assumed
    bare = plan_run(["experiment=tiny_table5_baseline"], num_gpus=None, skip_data=True)
    assert bare.zero["stage"] == 0 and "DDP assumed" in bare.zero["origin"] and bare.zero["num_gpus"] == 8


def test_launch_files_resolve_from_the_current_folder_then_from_the_project(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository root
    p = plan_run(["experiment=table3_llava15_7b_mmdu45k"], num_gpus=8,
                 accelerate_config="launch/accelerate/single_node_8gpu_zero3.yaml")
    assert p.zero["stage"] == 3
    mine = tmp_path / "my_zero2.yaml"  # a launcher of your own, next to you
    mine.write_text((REPO / "launch/accelerate/single_node_8gpu_zero2.yaml").read_text())
    p = plan_run(["experiment=table3_llava15_7b_mmdu45k"], num_gpus=None, accelerate_config="my_zero2.yaml")
    assert p.zero["stage"] == 2
    with pytest.raises(PlanError, match=r"accelerate config 'nope.yaml' not found \(tried .*nope.yaml or "):
        plan_run(["experiment=table3_llava15_7b_mmdu45k"], accelerate_config="nope.yaml")


def test_overrides_may_come_after_the_flags_and_the_help_is_plain_text(env, capsys):
    assert main(["--gpu", "h100", "experiment=table3_llava15_7b_mmdu45k", "--gpus", "4", "training.epochs=2"]) == 0
    out = capsys.readouterr().out
    assert "4 GPU(s), ZeRO stage 3" in out and "training.epochs=2" in out and "H100" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "Cost model" in text and "Memory per GPU" in text
    assert "``" not in text and "**" not in text and ":func:" not in text


def test_a_small_source_repeated_to_reach_its_ratio_is_warned_about(tmp_path, monkeypatch):
    from mmtune.data.synthetic import generate_synthetic

    monkeypatch.setenv("MMTUNE_CACHE_DIR", str(tmp_path / "cache"))
    syn = generate_synthetic(tmp_path / "syn", n_train=40, n_test=0, n_llava=5, image_size=16)
    files = [f"data.files=[{syn.train_json},{syn.llava_json}]", f"data.image_root={syn.image_dir}"]
    fair = plan_run(["model=llava_tiny", *files], num_gpus=1)
    assert not [n for n in fair.data["notes"] if "WARNING" in n]
    skewed = plan_run(["model=llava_tiny", *files, "data.ratios=[1,1]", "data.mixture.epoch_size=100"], num_gpus=1)
    (warning,) = [n for n in skewed.data["notes"] if "WARNING" in n]
    assert "source 'llava' has 5 record(s) but its ratio draws 50 samples per epoch" in warning
    assert "repeated 10.0 times an epoch" in warning and "data.ratios" in warning
    assert "WARNING: source 'llava'" in skewed.render()


def test_sequence_parallel_divides_activations_and_lengthens_the_longest_row():
    params = ParamCounts(total=8_000_000_000, vision=670_000_000, projector=45_000_000, language_model=7_300_000_000,
                         trainable=7_300_000_000, trainable_language_model=7_300_000_000, lora=0, hidden_size=3584,
                         num_layers=28, vocab_size=152064, image_tokens=64, source="test")
    common = dict(train_tokens=10**6, train_images=10, mean_sample_tokens=5000, micro_batch_tokens=32768,
                  optimizer_steps=10, weight_dtype="bfloat16", gradient_checkpointing=True, zero_stage=3,
                  offload_optimizer=False, offload_params=False, num_gpus=8, gpu=GPU_TYPES["h100"],
                  utilization=0.35, loss_impl="chunked")
    gib, s, d, L = 1024**3, 32768, 3584, 28
    one = estimate_cost(params, sequence_parallel=1, **common)
    four = estimate_cost(params, sequence_parallel=4, **common)
    assert one.memory_gib["activations"] == pytest.approx((2 * s * d * L + 34 * s * d) / gib)
    r = s // 4  # a GPU's tokens of the row, plus the whole row's embeddings
    assert four.memory_gib["activations"] == pytest.approx((2 * r * d * L + 34 * r * d + 2 * s * d) / gib)
    assert four.memory_gib["total"] < one.memory_gib["total"]
    assert four.sequence_parallel == 4 and four.longest_row_tokens % 4 == 0
    assert four.longest_row_tokens > 3 * one.longest_row_tokens > 0
    # the longest row is where the total meets the GPU's memory
    at = estimate_cost(params, sequence_parallel=4, **{**common, "micro_batch_tokens": four.longest_row_tokens})
    assert at.memory_gib["total"] == pytest.approx(GPU_TYPES["h100"].memory_gib, rel=1e-3)
