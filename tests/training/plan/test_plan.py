"""`mmtune plan` on every Table 3 / Table 5 experiment against generated stand-in data.

The stand-in tree mirrors the real layout under $MMTUNE_DATA_ROOT (MMDU-45k, llava-665k,
MMDU benchmark, MM-Vet) with the synthetic generator's files, and stand-in checkpoint
directories hold only a config.json: plan never reads weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mmtune.training import plan as plan_mod
from mmtune.training.plan import (
    GPU_TYPES,
    ParamCounts,
    PlanError,
    estimate_cost,
    main,
    plan_evaluation,
    plan_run,
)
from tests.support.experiments import declared_recipe

REPO = Path(__file__).resolve().parents[3]
EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "experiment").glob("table[35]_*.yaml"))




def test_every_table_row_has_an_experiment():
    assert len(EXPERIMENTS) >= 16
    assert {declared_recipe(e) for e in EXPERIMENTS} == {"sft", "evaluate"}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_plan_every_experiment(env, experiment: str):
    if declared_recipe(experiment) == "sft":
        p = plan_run([f"experiment={experiment}"], num_gpus=8, gpu="a100-80g",
                     accelerate_config="launch/accelerate/single_node_8gpu_zero3.yaml")
        assert p.run_name == experiment
        assert p.data["samples_per_epoch"] > 0 and p.data["tokens_per_epoch"] > 0
        assert all(s["kept"] == s["records"] > 0 for s in p.data["sources"])
        assert p.cost["optimizer_steps"] >= 1 and p.cost["gpu_hours"] > 0
        assert p.engine["name"] == "deepspeed" and p.engine["settings"]["stage"] == 3
        assert p.peft["method"] == "lora" and p.params["lora"] > 0
        assert p.params["trainable"] < 0.1 * p.params["total"]
        if "xc2" in experiment:
            assert 8.6e9 < p.params["total"] - p.params["lora"] < 8.75e9  # InternLM-XC2-VL: 8.67B
            assert p.context["factor"] == 1.0  # 16k within its 32k positions: no interpolation
        else:
            assert 7.0e9 < p.params["total"] - p.params["lora"] < 7.1e9  # LLaVA-1.5-7B: 7.06B
            assert p.context["factor"] == 2.0 and p.context["rope_scaling"] == "linear"
        text = p.render()
        assert "optimizer steps" in text and "GiB" in text and "DeepSpeed ZeRO-3" in text
    else:
        p = plan_evaluation([f"experiment={experiment}"], gpu="a100-80g")
        assert p.run_name == experiment
        mmdu = next(b for b in p.benchmarks if b["name"] == "mmdu")
        assert mmdu["items"] == 4 and mmdu["judge_calls"] == mmdu["answers"] > 0
        assert p.memory_gib["weights"] > 12 and p.fits
        assert "judge calls" in p.render()


def _lm_only(n: float, *, trainable: float | None = None, vision: float = 0, image_tokens: int = 0) -> ParamCounts:
    """A model of ``n`` language-model parameters (32 layers, width 4096) and a frozen vision tower."""
    trainable = n if trainable is None else trainable
    return ParamCounts(total=int(n + vision), vision=int(vision), projector=0, language_model=int(n),
                       trainable=int(trainable), trainable_language_model=int(trainable), lora=0, hidden_size=4096,
                       num_layers=32, vocab_size=32000, image_tokens=image_tokens, source="test")


def _zero(stage: int, params: ParamCounts, *, num_gpus: int = 8, weight_bytes: int = 2) -> dict:
    """``state`` and ``engine`` of :func:`estimate_cost` for DeepSpeed ZeRO-``stage`` (0: plain DDP)."""
    from mmtune.training.engines import engine_class
    from mmtune.training.engines.ddp import DDPEngineConfig
    from mmtune.training.engines.deepspeed import DeepSpeedEngineConfig

    name, config = ("deepspeed", DeepSpeedEngineConfig(stage=stage)) if stage else ("ddp", DDPEngineConfig())
    engine = engine_class(name)
    return {"state": engine.state_memory(config, total=params.total, trainable=params.trainable,
                                         weight_bytes=weight_bytes, num_gpus=num_gpus),
            "engine": engine.describe(config)}


def _cost(params: ParamCounts, zero_stage: int = 2, **settings):
    base = dict(train_tokens=10**6, train_images=0, mean_sample_tokens=0, micro_batch_tokens=64, optimizer_steps=1,
                weight_dtype="bfloat16", gradient_checkpointing=False, num_gpus=8, gpu=GPU_TYPES["h100"],
                utilization=0.5)
    state = _zero(zero_stage, params, num_gpus=settings.get("num_gpus", 8))
    return estimate_cost(params, **{**base, **state, **settings})


def test_training_compute_follows_the_published_counts():
    """Compute per token from Kaplan et al. 2020 ("Scaling Laws for Neural Language Models",
    section 2.1): a forward pass costs 2N FLOPs plus 2 * n_layer * n_ctx * d for attention, a
    backward pass twice the forward, so training costs 6N per token."""
    n = 10**9
    assert _cost(_lm_only(n)).flops == pytest.approx(6e15)  # 6 N D for D = 1e6 tokens
    # activation checkpointing runs every forward twice: 8 N D
    assert _cost(_lm_only(n), gradient_checkpointing=True).flops == pytest.approx(8e15)
    # frozen weights still pass gradients back to the activations, but compute none of their own: 4 N D
    assert _cost(_lm_only(n, trainable=0)).flops == pytest.approx(4e15)
    # 2048-token samples, 32 layers of width 4096: 2*32*2048*4096 = 536,870,912 forward FLOPs per token, x3
    with_attention = _cost(_lm_only(n), mean_sample_tokens=2048).flops
    assert with_attention == pytest.approx(6e15 + 1e6 * 3 * 536_870_912)
    # a frozen 300M-parameter vision tower runs forward once over 576 patch tokens of 1000 images
    with_images = _cost(_lm_only(n, vision=3 * 10**8, image_tokens=576), train_images=1000).flops
    assert with_images == pytest.approx(6e15 + 2 * 3e8 * 576 * 1000)
    # an H100's 989 dense bf16 TFLOP/s at 50% utilisation: 6e15 / 494.5e12 s = 12.13 s
    assert _cost(_lm_only(n)).gpu_hours == pytest.approx(12.1335 / 3600, rel=1e-4)


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_model_state_memory_matches_the_zero_paper(stage, gb):
    """Rajbhandari et al. 2020 ("ZeRO", figure 1): a 7.5B-parameter model trained with mixed-precision
    Adam on 64 GPUs holds 120 GB of model states per GPU without ZeRO, 31.4 GB with the optimizer
    states partitioned (stage 1), 16.6 GB adding gradients (stage 2) and 1.9 GB adding parameters (3)."""
    cost = _cost(_lm_only(7.5e9), zero_stage=stage, num_gpus=64)
    states = sum(cost.memory_gib[k] for k in ("weights", "gradients", "optimizer")) * 1024**3 / 1e9
    assert states == pytest.approx(gb, abs=0.05)


def test_fsdp2_counts_its_root_unit_whole_through_the_step_and_the_other_engines_do_not():
    """FSDP2's root unit (input embeddings, output head) is gathered at its forward and freed after
    its backward: on 8 GPUs a 1e9-parameter root in bf16 adds 7/8 of its 2 GB to the shards."""
    from mmtune.training.engines import engine_class
    from mmtune.training.engines.ddp import DDPEngineConfig
    from mmtune.training.engines.fsdp2 import FSDP2EngineConfig

    common = dict(total=7 * 10**9, trainable=7 * 10**9, weight_bytes=2, num_gpus=8, num_layers=32)
    fsdp2 = engine_class("fsdp2")
    plain = fsdp2.state_memory(FSDP2EngineConfig(), **common)
    rooted = fsdp2.state_memory(FSDP2EngineConfig(), **common, root_params=10**9)
    assert rooted.gathered - plain.gathered == pytest.approx(2e9 * 7 / 8)
    assert (rooted.weights, rooted.gradients, rooted.optimizer) == (plain.weights, plain.gradients, plain.optimizer)
    assert fsdp2.state_memory(FSDP2EngineConfig(), **{**common, "num_gpus": 1}, root_params=10**9).gathered == 0
    ddp = engine_class("ddp")
    assert ddp.state_memory(DDPEngineConfig(), **common, root_params=10**9) == ddp.state_memory(DDPEngineConfig(),
                                                                                                **common)


def test_activation_memory_matches_the_published_per_layer_count():
    """Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    section 4.1): a layer keeps 34 * s * h bytes of 16-bit activations for s tokens of width h
    once attention no longer stores its s x s scores (flash attention); with full recomputation
    only each layer's 2 * s * h byte input is kept, plus one layer's activations while it is
    recomputed. 8192 tokens of width 4096 in 32 layers: 34 * 2^13 * 2^12 * 2^5 bytes = 34 GiB."""
    params = _lm_only(7e9)
    assert _cost(params, micro_batch_tokens=8192).memory_gib["activations"] == pytest.approx(34.0)
    assert _cost(params, micro_batch_tokens=8192, gradient_checkpointing=True).memory_gib["activations"] == (
        pytest.approx(2.0 + 34 / 32))


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
    assert all(p["engine"]["settings"]["stage"] == 3 for p in plans)
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
    # The experiment's typed `recipe` key decides, without --recipe.
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
                  optimizer_steps=10, weight_dtype="bfloat16", gradient_checkpointing=True, num_gpus=8, gpu=GPU_TYPES["a100-80g"],
                  utilization=0.35, **_zero(3, params))
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
    experiment = next(e for e in EXPERIMENTS if declared_recipe(e) == "evaluate" and "mmdu" in e)
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
    assert own.engine["settings"]["stage"] == 3 and own.engine["num_gpus"] == 8  # num_processes of the launcher
    assert "the experiment's launcher (its `launcher` key)" in own.engine["origin"]
    assert own.cost["memory_gib"] == given.cost["memory_gib"]
    # an experiment without a launcher: the engine of its config (training.backend), DDP
    bare = plan_run(["experiment=tiny_table5_baseline"], num_gpus=None, skip_data=True)
    assert bare.engine["name"] == "ddp" and bare.engine["num_gpus"] == 8
    assert "training.backend.engine=ddp" in bare.engine["origin"]


def test_launch_files_resolve_from_the_current_folder_then_from_the_project(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository root
    p = plan_run(["experiment=table3_llava15_7b_mmdu45k"], num_gpus=8,
                 accelerate_config="launch/accelerate/single_node_8gpu_zero3.yaml")
    assert p.engine["settings"]["stage"] == 3
    mine = tmp_path / "my_zero2.yaml"  # a launcher of your own, next to you
    mine.write_text((REPO / "launch/accelerate/single_node_8gpu_zero2.yaml").read_text())
    p = plan_run(["experiment=table3_llava15_7b_mmdu45k", "training.backend.deepspeed.stage=2",
                  "launcher=my_zero2.yaml"], num_gpus=None)
    assert p.engine["settings"]["stage"] == 2
    # the DeepSpeed JSON the launcher names is read from the project too, and checked by the engine
    with pytest.raises(PlanError, match=r"training.backend.deepspeed.stage=3 but my_zero2.yaml -> "
                                        r"launch/deepspeed/zero2.json launches ZeRO-2"):
        plan_run(["experiment=table3_llava15_7b_mmdu45k"], num_gpus=None, accelerate_config="my_zero2.yaml")
    with pytest.raises(PlanError, match=r"accelerate config 'nope.yaml' not found \(tried .*nope.yaml or "):
        plan_run(["experiment=table3_llava15_7b_mmdu45k"], accelerate_config="nope.yaml")


def test_overrides_may_come_after_the_flags_and_the_help_is_plain_text(env, capsys):
    assert main(["--gpu", "h100", "experiment=table3_llava15_7b_mmdu45k", "--gpus", "4", "training.epochs=2"]) == 0
    out = capsys.readouterr().out
    assert "4 GPU(s), DeepSpeed ZeRO-3" in out and "training.epochs=2" in out and "H100" in out
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
                  optimizer_steps=10, weight_dtype="bfloat16", gradient_checkpointing=True, num_gpus=8, gpu=GPU_TYPES["h100"],
                  utilization=0.35, loss_impl="chunked", **_zero(3, params))
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


def test_a_launch_file_for_another_engine_or_another_zero_stage_is_refused_by_the_engine(env):
    """The engine class reads the accelerate config (Engine.launch_config_problem), as at start-up."""
    zero3 = "launch/accelerate/single_node_8gpu_zero3.yaml"
    with pytest.raises(PlanError, match=r"training.backend.engine=fsdp2 but .*zero3.yaml launches deepspeed "
                                        r"\(distributed_type DEEPSPEED\): set training.backend.engine=deepspeed"):
        plan_run(["experiment=table3_llava15_7b_mmdu45k", "training.backend.engine=fsdp2"], num_gpus=8,
                 accelerate_config=zero3)
    with pytest.raises(PlanError, match=r"training.backend.deepspeed.stage=2 but .*zero3.yaml -> .*zero3.json launches ZeRO-3"):
        plan_run(["experiment=table3_llava15_7b_mmdu45k", "training.backend.deepspeed.stage=2"], num_gpus=8,
                 accelerate_config=zero3)
    fsdp2 = plan_run(["experiment=table3_llava15_7b_mmdu45k", "training.backend.engine=fsdp2",
                      "launcher=launch/accelerate/single_node_8gpu_fsdp2.yaml"], num_gpus=None)
    assert fsdp2.engine["name"] == "fsdp2" and fsdp2.engine["num_gpus"] == 8
    assert fsdp2.engine["description"].startswith("FSDP2")
