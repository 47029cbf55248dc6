"""Exact resume after SIGKILL: same losses as an uninterrupted run, no sample skipped or repeated."""

import json
from pathlib import Path

import pytest

from tests.support.processes import (assert_same_weights, final_weights, kill_and_resume, read_jsonl, run_ok,
                                     step_sample_ids, torchrun)

# Packed rows (one row of up to 768 tokens per micro-batch; epochs of 8 and 9 rows, two per
# step, so each epoch ends in a partial group) must resume as exactly as padded batches.
_PACKED = ("packing", "collator.batch_size=1", "collator.max_length=768", "collator.packing_window=8",
           "training.gradient_accumulation_steps=2")


@pytest.mark.parametrize("batching", [("padding",), pytest.param(_PACKED, marks=pytest.mark.slow)],
                         ids=["padding", "packing"])
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, synthetic_dir, tiny_overrides, batching):
    common = ("training.epochs=2", "training.save_every_steps=3", "training.log_sample_ids=true",
              "training.save_final=false", "training.resume=auto", "training.lr=3e-3",
              f"collator.batching={batching[0]}", *batching[1:])
    run = kill_and_resume(tmp_path, synthetic_dir, tiny_overrides, common)
    resume_step, before_kill_metrics, killed_dir = run.resume_step, run.before_kill_metrics, run.killed_dir
    assert resume_step >= 3 and resume_step % 3 == 0
    assert before_kill_metrics[-1]["step"] > resume_step, "the killed attempt should have logged past its checkpoint"

    ids, metrics = read_jsonl(killed_dir / "sample_ids.jsonl"), read_jsonl(killed_dir / "metrics.jsonl")
    reference_dir = run.reference_dir
    ref_ids, ref_metrics = read_jsonl(reference_dir / "sample_ids.jsonl"), read_jsonl(reference_dir / "metrics.jsonl")
    if batching[0] == "padding":
        assert ref_metrics[-1]["step"] == 16  # 32 samples / 4 per batch x 2 epochs
    # The logs were cut back to the checkpoint on resume: every step appears once.
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics] == list(range(1, len(ref_metrics) + 1))
    # Losses after the resume equal the uninterrupted run's, step for step.
    ref_loss = {m["step"]: m["train/loss"] for m in ref_metrics}
    after = [(m["step"], m["train/loss"]) for m in metrics if m["step"] > resume_step]
    assert after and after == [(step, ref_loss[step]) for step, _ in after]
    # The samples of every step match, so none is skipped or seen twice.
    assert ids == ref_ids
    for epoch in range(2):
        seen = [i for s in ids if s["epoch"] == epoch for r in s["ranks"] for mb in r["ids"] for i in mb]
        assert len(seen) == len(set(seen)) == 32


@pytest.mark.slow
def test_a_checkpoint_of_two_ddp_ranks_resumes_on_one_with_twice_the_accumulation(tmp_path, synthetic_dir,
                                                                                  tiny_overrides):
    """accelerate saves DDP's full weights and optimizer once: on one process with 2 micro-batches per
    step (the same global batch) the run continues to the 2-rank run's losses and final weights, from
    inside the first epoch and from its end."""
    import shutil

    common = ("training.epochs=2", "training.max_steps=6", "training.save_every_steps=2", "training.resume=auto",
              "training.lr=2e-4", "training.log_sample_ids=true")  # 4 steps per epoch
    reference = tmp_path / "reference"
    run_ok([*torchrun(2), *tiny_overrides(reference, synthetic_dir, *common)])
    expected = read_jsonl(reference / "metrics.jsonl")
    assert [m["step"] for m in expected] == [1, 2, 3, 4, 5, 6]
    for step, position in ((2, "step 2, epoch 0, micro-batch 4"), (4, "step 4, epoch 0, micro-batch 8")):
        # The step-N checkpoint, as a run stopped after it leaves it (a save is whole or absent).
        on_one = tmp_path / f"on_one_from_{step}"
        shutil.copytree(reference, on_one, ignore=lambda _, names: [n for n in names if n == "final" or (
            n.startswith("step-") and n != f"step-{step}")])
        out = run_ok([*torchrun(1), *tiny_overrides(on_one, synthetic_dir, *common,
                                                   "training.gradient_accumulation_steps=2")])
        assert f"{position} of the epoch" in out  # 2 ranks' micro-batches each step
        logged = read_jsonl(on_one / "metrics.jsonl")
        assert [m["step"] for m in logged] == [1, 2, 3, 4, 5, 6]
        for key in ("train/loss", "train/grad_norm", "train/lr", "train/loss_tokens", "train/epoch"):
            assert [m[key] for m in logged[step:]] == pytest.approx([m[key] for m in expected[step:]], rel=1e-5), key
        assert step_sample_ids(on_one) == step_sample_ids(reference)
        assert_same_weights(final_weights(on_one / "final", "llava"), final_weights(reference / "final", "llava"))


@pytest.mark.slow
def test_a_checkpoint_of_one_process_resumes_on_two_ddp_ranks_with_half_the_accumulation(tmp_path, synthetic_dir,
                                                                                         tiny_overrides):
    """The other way: the second rank has no random state of its own in the checkpoint (said at start-up)
    and the two ranks continue the one-process run's losses and final weights."""
    import shutil

    common = ("training.max_steps=4", "training.save_every_steps=2", "training.resume=auto", "training.lr=2e-4",
              "training.log_sample_ids=true")
    reference, on_two = tmp_path / "reference", tmp_path / "on_two"
    run_ok([*torchrun(1), *tiny_overrides(reference, synthetic_dir, *common, "training.gradient_accumulation_steps=2")])
    shutil.copytree(reference, on_two, ignore=shutil.ignore_patterns("final"))
    out = run_ok([*torchrun(2), *tiny_overrides(on_two, synthetic_dir, *common)])
    assert "step 2, epoch 0, micro-batch 2 of the epoch" in out  # 4 micro-batches of one process, 2 on each rank
    assert "the checkpoint holds those of 1 process(es); processes 1..1 have none" in out
    logged, expected = read_jsonl(on_two / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    assert [m["step"] for m in logged] == [m["step"] for m in expected] == [1, 2, 3, 4]
    for key in ("train/loss", "train/grad_norm", "train/lr", "train/loss_tokens"):
        assert [m[key] for m in logged[2:]] == pytest.approx([m[key] for m in expected[2:]], rel=1e-5), key
    assert [len(s["ranks"]) for s in read_jsonl(on_two / "sample_ids.jsonl")] == [1, 1, 2, 2]
    assert step_sample_ids(on_two) == step_sample_ids(reference)
    assert_same_weights(final_weights(on_two / "final", "llava"), final_weights(reference / "final", "llava"))


def _train(tmp_path, synthetic_dir, tiny_overrides, *extra, name="run"):
    """One in-process run into ``tmp_path / name``: setup, train, save, cleanup."""
    from accelerate.state import AcceleratorState, GradientState

    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    common = ("training.lr_scheduler=constant", "training.warmup_ratio=0", "training.keep_last=3", "training.lr=1e-3")
    recipe = SFTRecipe(to_sft_config(compose_sft_config(tiny_overrides(tmp_path / name, synthetic_dir, *common,
                                                                        *extra))))
    try:
        recipe.setup()
        recipe.train()
        recipe.save()
        recipe.cleanup()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return recipe


def test_resume_with_a_changed_config_is_refused_unless_allowed_and_then_takes_effect_and_is_recorded(
        tmp_path, synthetic_dir, tiny_overrides):
    import shutil

    from mmtune.training.checkpoint import ResumeConfigError, read_trainer_state

    run = tmp_path / "run"
    steps = ("training.max_steps=3", "training.save_every_steps=1")
    _train(tmp_path, synthetic_dir, tiny_overrides, *steps, "training.save_final=false")
    shutil.rmtree(run / "checkpoints" / "step-2")  # as if killed during step 3: resume from step 1
    logged = (run / "metrics.jsonl").read_text()

    # Another lr, scheduler and weight decay: refused before anything is built or cut, each key named.
    with pytest.raises(ResumeConfigError) as info:
        _train(tmp_path, synthetic_dir, tiny_overrides, *steps, "training.resume=auto",
               "training.lr=2e-3", "training.lr_scheduler=linear", "training.weight_decay=0.1",
               "logging.every_steps=2", "training.keep_last=4")  # the last two may differ freely
    message = str(info.value)
    assert f"cannot resume from {run / 'checkpoints' / 'step-1'} (step 1)" in message
    assert "training.lr: 0.001 -> 0.002" in message and "training.lr_scheduler: 'constant' -> 'linear'" in message
    assert "training.weight_decay: 0.0 -> 0.1" in message
    assert "logging" not in message and "keep_last" not in message
    assert "training.resume_config_changes=[training.lr,training.lr_scheduler,training.weight_decay]" in message
    assert (run / "metrics.jsonl").read_text() == logged

    # Allowed: the new lr is what steps 2-3 train with, and the change is recorded with its first step.
    recipe = _train(tmp_path, synthetic_dir, tiny_overrides, *steps, "training.resume=auto", "training.lr=2e-3",
                    "training.resume_config_changes=[training.lr]", "training.save_final=false")
    assert [g["lr"] for g in recipe.optimizer.param_groups] == [2e-3] * len(recipe.optimizer.param_groups)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/lr"]) for r in rows] == [(1, 1e-3), (2, 2e-3), (3, 2e-3)]
    change = {"effective_from_step": 2, "resumed_from": str(run / "checkpoints" / "step-1"),
              "changes": {"training.lr": {"old": 1e-3, "new": 2e-3}}}
    state = read_trainer_state(run / "checkpoints" / "step-2")  # saved after the change: carries it
    assert state["config_changes"] == [change] and state["config"]["training"]["lr"] == 2e-3

    # Resumed again from step 2 with the same (new) config: nothing new to allow; the record stays.
    _train(tmp_path, synthetic_dir, tiny_overrides, *steps, "training.resume=auto", "training.lr=2e-3")
    final = json.loads((run / "final" / "mmtune_run.json").read_text())
    assert final["config_changes"] == [change] and final["config"]["training"]["lr"] == 2e-3


def test_after_a_full_disk_the_last_checkpoint_resumes_the_run(tmp_path, synthetic_dir, tiny_overrides, monkeypatch):
    import errno

    import torch

    from mmtune.io.disk import DiskFullError

    run = tmp_path / "run"
    real_save = torch.save

    def full_at_step_2(obj, f, *args, **kwargs):
        if ".tmp-step-2" in str(f):
            Path(f).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    steps = ("training.max_steps=3", "training.save_every_steps=1")
    monkeypatch.setattr(torch, "save", full_at_step_2)
    with pytest.raises(DiskFullError, match=rf"checkpoint step 2 .*The last complete checkpoint, "
                                            rf"{run / 'checkpoints' / 'step-1'} \(step 1\), is intact"):
        _train(tmp_path, synthetic_dir, tiny_overrides, *steps)
    monkeypatch.undo()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]

    resumed = _train(tmp_path, synthetic_dir, tiny_overrides, *steps, "training.resume=auto")
    assert resumed.step == 3 and (run / "final" / "mmtune_run.json").is_file()
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
