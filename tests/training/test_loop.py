"""The training loop: token-weighted loss across micro-batches, freezing, group learning rates."""

import copy
import json

import pytest
import torch

from mmtune.training.config import to_sft_config
from mmtune.training.demo import compose_sft_config
from mmtune.training.loop import SFTRecipe
from mmtune.training.loss import materialized_cross_entropy_sum


@pytest.fixture
def make_recipe(tmp_path, synthetic_dir, tiny_overrides):
    def make(*extra):
        cfg = to_sft_config(compose_sft_config(tiny_overrides(tmp_path / "run", synthetic_dir, *extra)))
        recipe = SFTRecipe(cfg)
        recipe.setup()
        return recipe
    return make




def test_accumulated_gradient_is_the_token_weighted_mean(make_recipe):
    recipe = make_recipe("training.gradient_accumulation_steps=3", "training.max_steps=1",
                     "training.max_grad_norm=null", "collator.batch_size=2")
    reference = copy.deepcopy(recipe.accelerator.unwrap_model(recipe.model))
    captured = {}
    inner_step = recipe.optimizer.optimizer.step

    def capture_then_step(*args, **kwargs):
        captured.update({n: p.grad.clone() for n, p in recipe.model.named_parameters() if p.grad is not None})
        return inner_step(*args, **kwargs)

    recipe.optimizer.optimizer.step = capture_then_step
    micro = [item for item, _ in zip(recipe.data.dataloader(0), range(3))]
    recipe.train()

    # Reference: one backward of (sum of token losses of all 3 micro-batches) / (their loss tokens).
    total_tokens = sum(int(batch["num_loss_tokens"]) for batch, _ in micro)
    assert len({int(b["num_loss_tokens"]) for b, _ in micro}) > 1, "micro-batches should differ in loss tokens"
    loss = 0
    for batch, _ in micro:
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"], pixel_values=batch["pixel_values"]).logits
        loss = loss + materialized_cross_entropy_sum(logits, batch["labels"])
    (loss / total_tokens).backward()
    assert captured
    for name, param in reference.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(captured[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    recipe.cleanup()


def test_frozen_groups_stay_fixed_and_group_lrs_apply(make_recipe):
    recipe = make_recipe("training.max_steps=2", "training.vision.train=false",
                     "training.projector.lr=1e-2", "training.lr=1e-3", "training.warmup_ratio=0.0",
                     "training.lr_scheduler=constant")
    model = recipe.accelerator.unwrap_model(recipe.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    recipe.train()
    vision = [n for n in before if ".vision_tower." in n]
    projector = [n for n in before if ".multi_modal_projector." in n]
    assert vision and projector
    params = dict(model.named_parameters())
    assert all(torch.equal(before[n], params[n]) for n in vision)
    assert all(not params[n].requires_grad for n in vision)
    assert any(not torch.equal(before[n], params[n]) for n in projector)
    lrs = {g["name"]: g["lr"] for g in recipe.optimizer.param_groups}
    assert lrs["projector/decay"] == pytest.approx(1e-2) and lrs["language_model/decay"] == pytest.approx(1e-3)
    assert not any(name.startswith("vision/") for name in lrs)
    # no weight decay on norms and biases
    for group in recipe.optimizer.param_groups:
        if group["name"].endswith("no_decay"):
            assert group["weight_decay"] == 0.0 and all(p.ndim < 2 for p in group["params"])
    recipe.cleanup()


def test_every_epoch_of_a_packed_plan_trains_each_sample_once(make_recipe, tmp_path):
    # Windows of 12 samples into 640-token rows: the epochs' plans hold 11 and 10 rows, and
    # 3 micro-batches per step leave a partial last group in both epochs.
    recipe = make_recipe("collator.batching=packing", "collator.batch_size=1", "collator.max_length=640",
                         "collator.packing_window=12", "training.gradient_accumulation_steps=3",
                         "training.epochs=2", "training.log_sample_ids=true",
                         "training.gradient_checkpointing=false")  # faster; not what is tested
    real = [recipe.data.rank_plan(epoch).real for epoch in range(2)]
    assert len(set(real)) > 1, "the epochs' plans should differ in length"
    assert all(n % 3 for n in real), "each epoch should end on a partial group"
    assert recipe.steps_per_epoch == [-(-n // 3) for n in real]
    assert recipe.total_steps == sum(recipe.steps_per_epoch)
    recipe.train()
    recipe.cleanup()
    rows = [json.loads(line) for line in (tmp_path / "run" / "sample_ids.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, recipe.total_steps + 1))
    assert [r["epoch"] for r in rows] == [e for e, n in enumerate(recipe.steps_per_epoch) for _ in range(n)]
    for epoch in range(2):
        ids = [i for r in rows if r["epoch"] == epoch for mb in r["ranks"][0]["ids"] for i in mb]
        assert len(ids) == len(set(ids)) == 32, epoch
    # The last step of an epoch trains its real micro-batches; the fillers that complete it carry no ids.
    last_of_epoch_0 = rows[recipe.steps_per_epoch[0] - 1]["ranks"][0]["ids"]
    assert last_of_epoch_0[0] and [len(mb) > 0 for mb in last_of_epoch_0] == \
        [True] * (real[0] - 3 * (recipe.steps_per_epoch[0] - 1)) + [False] * (3 * recipe.steps_per_epoch[0] - real[0])


@pytest.mark.slow
def test_a_partial_last_group_is_weighted_by_its_own_loss_tokens(make_recipe, tmp_path):
    # One epoch of 8 packed rows at 3 per step: the third step has 2 real micro-batches and a filler.
    recipe = make_recipe("collator.batching=packing", "collator.batch_size=1", "collator.max_length=768",
                         "collator.packing_window=8", "training.gradient_accumulation_steps=3",
                         "training.max_grad_norm=null")
    rp = recipe.data.rank_plan(0)
    assert rp.real % 3 and rp.fillers == 3 - rp.real % 3
    model = recipe.accelerator.unwrap_model(recipe.model)
    reference = copy.deepcopy(model)
    captured = []
    inner_step = recipe.optimizer.optimizer.step

    def capture_then_step(*args, **kwargs):
        # The gradient, and the weights it was computed at.
        captured.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                         {n: p.detach().clone() for n, p in model.named_parameters()}))
        return inner_step(*args, **kwargs)

    recipe.optimizer.optimizer.step = capture_then_step
    last = list(recipe.data.dataloader(0, start=3 * (rp.steps - 1)))
    recipe.train()
    recipe.cleanup()
    assert len(captured) == rp.steps and [bool(m.get("filler")) for _, m in last].count(True) == rp.fillers
    real_batches = [b for b, m in last if not m.get("filler")]
    gradient, weights = captured[-1]
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(weights[name])
    inputs = ("input_ids", "attention_mask", "position_ids", "pixel_values")
    loss = sum(materialized_cross_entropy_sum(reference(**{k: b[k] for k in inputs}, use_cache=False).logits,
                                              b["labels"])
               for b in real_batches)
    (loss / sum(int(b["num_loss_tokens"]) for b in real_batches)).backward()
    for name, param in reference.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(gradient[name], param.grad, rtol=1e-4, atol=1e-6)
    # The gradient norm is logged even without clipping.
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["train/grad_norm"]
    assert logged == pytest.approx(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in gradient.values()]))),
                                   rel=1e-5)


def _engine(name, **settings):
    from mmtune.training.engines import build_engine, engine_class

    return build_engine(name, engine_class(name).settings_class(**settings))


def test_in_training_evaluation_runs_under_every_engine_and_an_engine_can_still_refuse_it():
    from types import SimpleNamespace

    from mmtune.training.loop import check_evaluation_layout

    both = SimpleNamespace(eval_before=True, eval_after=True)
    # Sharded weights on several ranks: each rank generates on the full weights its engine gathers.
    for engine in (_engine("deepspeed", stage=3), _engine("fsdp2"), _engine("deepspeed", stage=2), _engine("ddp")):
        check_evaluation_layout(both, engine, num_processes=8)
    refusing = SimpleNamespace(evaluation_problem=lambda n: f"an engine that cannot on {n} processes")
    with pytest.raises(ValueError, match=r"training.eval_before and training.eval_after=true cannot run under an "
                                         r"engine that cannot on 8 processes.*training.eval_before=false "
                                         r"training.eval_after=false"):
        check_evaluation_layout(both, refusing, num_processes=8)
    check_evaluation_layout(SimpleNamespace(eval_before=False, eval_after=False), refusing, num_processes=8)
    # a 4-bit (QLoRA) base cannot be rebuilt into a full copy: refused on several FSDP2 processes
    from mmtune.training.engines import EngineContext, build_engine, engine_class

    qlora = build_engine("fsdp2", engine_class("fsdp2").settings_class(), EngineContext(quantized_base=True))
    with pytest.raises(ValueError, match=r"training.eval_after=true cannot run under FSDP2 on 2 processes with a "
                                         r"4-bit \(QLoRA\) base"):
        check_evaluation_layout(SimpleNamespace(eval_before=False, eval_after=True), qlora, num_processes=2)
    check_evaluation_layout(both, qlora, num_processes=1)


def _saved_on(ranks, accumulation, consumed=2):
    """A trainer state as a run on ``ranks`` processes x ``accumulation`` saves it (the parts a layout check reads)."""
    return {"step": consumed // accumulation, "num_processes": ranks,
            "data": {"epoch": 0, "consumed": consumed, "global_consumed": consumed * ranks,
                     "global_batch": ranks * accumulation, "world_size": ranks, "accumulation": accumulation}}


def test_a_resume_on_another_number_of_ranks_is_checked_by_the_engine_and_the_global_batch():
    from mmtune.training.checkpoint import ResumeConfigError
    from mmtune.training.layout import RankLayout
    from mmtune.training.resume import check_resume_layout

    def on(num_processes, accumulation):
        return RankLayout(num_processes=num_processes, accumulation=accumulation)

    # DDP and FSDP2 load on any number of processes: only the global batch must stay.
    for name in ("ddp", "fsdp2"):
        assert _engine(name).reshard_problem(2, 1) == ""
        said = check_resume_layout("ckpt", _saved_on(2, 1), _engine(name), on(1, 2))
        assert said.startswith("resuming on 1 rank(s) x 2 micro-batch(es) per step, saved on 2 x 1: the same 2 ")
        assert check_resume_layout("ckpt", _saved_on(2, 1), _engine(name), on(2, 1)) == ""
    with pytest.raises(ResumeConfigError, match=r"cannot resume from ckpt \(step 2\) on 1 process\(es\): it was "
                                                r"saved on 2 ranks x training.gradient_accumulation_steps=1 .* Set "
                                                r"training.gradient_accumulation_steps=2 to keep 2 micro-batches"):
        check_resume_layout("ckpt", _saved_on(2, 1), _engine("fsdp2"), on(1, 1))
    # DeepSpeed's ZeRO partitions load on their own number of processes only: refused, checked without
    # launching DeepSpeed, with the data's problem in the same message.
    zero = _engine("deepspeed", stage=2)
    assert zero.reshard_problem(2, 2) == ""
    with pytest.raises(ResumeConfigError) as refused:
        check_resume_layout("ckpt", _saved_on(2, 1), zero, on(1, 1))
    said = str(refused.value)
    assert ("DeepSpeed ZeRO-2 saved its optimizer states in 2 per-rank partitions, which its load_checkpoint "
            "restores onto 2 processes only (this run has 1)") in said
    assert "Relaunch on 2 processes (accelerate launch --num_processes 2 --config_file" in said
    assert "deepspeed.checkpoint.ds_to_universal" in said and "Set training.gradient_accumulation_steps=2" in said
    assert "optimizer states and weights in 4 per-rank" in _engine("deepspeed", stage=3).reshard_problem(4, 8)


def test_a_resume_with_another_global_batch_is_refused_before_the_model_is_built(make_recipe, tmp_path,
                                                                                   synthetic_dir, tiny_overrides,
                                                                                   monkeypatch):
    from mmtune.training.checkpoint import ResumeConfigError

    from accelerate.state import AcceleratorState, GradientState

    saving = make_recipe("training.max_steps=2", "training.save_every_steps=1", "training.gradient_accumulation_steps=2",
                         "training.save_final=false")
    saving.train()
    saving.cleanup()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    resumed = SFTRecipe(to_sft_config(compose_sft_config(tiny_overrides(
        tmp_path / "run", synthetic_dir, "training.max_steps=2", "training.resume=auto",
        "training.gradient_accumulation_steps=1"))))
    monkeypatch.setattr(SFTRecipe, "_build_model", lambda self: pytest.fail("the model was built before the refusal"))
    with pytest.raises(ResumeConfigError, match=r"saved on 1 rank x training.gradient_accumulation_steps=2 \(2 "
                                                r"micro-batches per optimizer step\), this run has 1 rank x 1 \(1\).* "
                                                r"Set training.gradient_accumulation_steps=2"):
        resumed.setup()
    resumed.output_lock.release()


@pytest.mark.slow  # a second interpreter holding the lock; the default suite checks the lock in tests/io
def test_a_second_training_job_in_the_same_output_dir_is_refused(make_recipe, tmp_path, synthetic_dir, tiny_overrides):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mmtune.io.locks import DirectoryLockedError, lock_directory

    repo = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "run"
    # Another process holds the folder: this job stops in setup, before writing anything.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mmtune.io.locks import lock_directory; "
                               "lock_directory(sys.argv[1], purpose='training'); print('locked', flush=True); "
                               "time.sleep(600)", str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryLockedError, match=rf"in use by another process: pid {holder.pid} .*"
                                                       r"set training.output_dir to another folder"):
            make_recipe("training.max_steps=1")
        assert not (run_dir / "data_report.json").exists() and not (run_dir / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()

    # This process trains there now; a second real job (recipes/sft.py) is refused naming it.
    recipe = make_recipe("training.max_steps=1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    second = subprocess.run([sys.executable, str(repo / "recipes" / "sft.py"),
                             *tiny_overrides(run_dir, synthetic_dir, "training.max_steps=1", "training.resume=auto")],
                            cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode != 0
    assert f"in use by another process: pid {os.getpid()}" in second.stderr, second.stderr[-3000:]
    recipe.cleanup()  # releases the folder
    with lock_directory(run_dir):
        pass


def test_a_secret_interpolated_into_the_config_reaches_no_file_and_no_wandb_record(make_recipe, tmp_path, monkeypatch):
    """``run_name`` and a W&B tag interpolated from the judge's key variable (with the stray
    line break a pasted key has): mmtune_run.json, the checkpoints, metrics and the offline
    W&B run hold ``***`` where the key would be."""
    key = "sk-test-SECRET-4f7a9c0123"
    monkeypatch.setenv("MMTUNE_JUDGE_API_KEY", key + "\n")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = make_recipe("training.max_steps=2", "training.save_every_steps=1", "logging.wandb=true",
                         "run_name=run-${oc.env:MMTUNE_JUDGE_API_KEY}", "logging.tags=[unit,'${oc.env:MMTUNE_JUDGE_API_KEY}']")
    assert key in recipe.cfg.run_name  # the resolved config does hold it
    run = recipe.logger.wandb_run
    assert key not in run.name and "***" in run.name and [t.strip() for t in run.tags] == ["unit", "***"]
    assert key not in json.dumps(dict(run.config), default=str)
    recipe.train()
    recipe.save()
    recipe.cleanup()
    metadata = json.loads((tmp_path / "run" / "final" / "mmtune_run.json").read_text())
    assert metadata["run"].startswith("run-***") and metadata["config"]["run_name"].startswith("run-***")
    assert [t.strip() for t in metadata["config"]["logging"]["tags"]] == ["unit", "***"]
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and p.suffix != ".safetensors"]
    assert any(p.name == "trainer_state.json" for p in files), sorted(str(p.relative_to(tmp_path)) for p in files)
    assert not [p for p in files if key.encode() in p.read_bytes()]


@pytest.mark.parametrize("tolerated", [0, 1])
def test_a_non_finite_loss_stops_the_run_naming_the_step_and_samples_and_saves_nothing_after_it(make_recipe, tolerated):
    from mmtune.training.checkpoint import complete_checkpoints
    from mmtune.training.nonfinite import NonFiniteTrainingError

    recipe = make_recipe("training.max_steps=6", "training.save_every_steps=1", "training.keep_last=10",
                         "training.log_sample_ids=true", f"training.max_nonfinite_steps={tolerated}")
    model = recipe.accelerator.unwrap_model(recipe.model)
    embeddings = model.get_input_embeddings()
    # From step 3 on, every forward turns NaN (as weights overwritten with garbage would).
    embeddings.register_forward_hook(lambda module, args, out: out * float("nan") if recipe.step >= 2 else out)
    with pytest.raises(NonFiniteTrainingError) as info:
        recipe.train()
    stopped = 3 + tolerated
    message = str(info.value)
    assert f"training stopped at a non-finite step, step {stopped}: loss nan" in message
    logged = [json.loads(line) for line in (recipe.output_dir / "sample_ids.jsonl").read_text().splitlines()]
    ids = [i for rank in logged[-1]["ranks"] for batch in rank["ids"] for i in batch]
    assert logged[-1]["step"] == stopped and ids and all(i in message for i in ids[:3])
    # Checkpoints of the good steps only; no NaN update reached the weights (the bad ones were skipped).
    assert [p.name for p in complete_checkpoints(recipe.output_dir)] == ["step-1", "step-2"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(NonFiniteTrainingError, match=r"final/ not saved: step \d+ had a non-finite loss"):
        recipe.save()
    assert not (recipe.output_dir / "final").exists()
    recipe.cleanup()


def test_the_guard_does_not_count_the_fp16_scalers_overflow_steps():
    from mmtune.training.nonfinite import NonFiniteGuard, NonFiniteTrainingError

    scaled, plain = NonFiniteGuard(0, loss_scaled=True), NonFiniteGuard(0)
    assert scaled.allows_update(float("inf")) and scaled.observe(1, 2.5, float("inf"), [["a"]]) is None
    assert not scaled.save_problem()
    assert not plain.allows_update(float("inf"))
    with pytest.raises(NonFiniteTrainingError, match=r"step 1: loss 2.5, gradient norm inf \(samples: a\)"):
        plain.observe(1, 2.5, float("inf"), [["a"]])
