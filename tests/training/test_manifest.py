"""Checkpoints carry a manifest; a resume checks it, falls back to the newest complete one or
refuses, naming both."""

import json

import pytest
import torch
from accelerate import Accelerator

from mmtune.training.checkpoint import (TRAINER_STATE, CheckpointManager, complete_checkpoints, latest_checkpoint,
                                       read_trainer_state, recover_interrupted_saves)
from mmtune.training.manifest import (MANIFEST, IncompleteCheckpointError, choose_resume_checkpoint,
                                      manifest_problems)


@pytest.fixture
def run(tmp_path):
    """A run folder with real accelerate checkpoints at steps 1, 2 and 3."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(torch.nn.Linear(4, 2), torch.optim.AdamW(torch.nn.Linear(4, 2).parameters()))
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        manager.save(accelerator, step, {"epoch": 0, "micro_batches_done": step})
    return tmp_path


def _choose(run, requested):
    return choose_resume_checkpoint(requested, lambda: complete_checkpoints(run),
                                    lambda c: read_trainer_state(c)["step"])


def test_every_file_of_a_checkpoint_is_listed_with_its_size_and_the_marker_comes_after(run):
    step3 = run / "checkpoints" / "step-3"
    listed = json.loads((step3 / MANIFEST).read_text())["files"]
    on_disk = {p.relative_to(step3).as_posix(): p.stat().st_size for p in step3.rglob("*") if p.is_file()}
    assert listed == {k: v for k, v in on_disk.items() if k not in (MANIFEST, TRAINER_STATE)}
    assert "model.safetensors" in listed and len(listed) >= 3
    assert manifest_problems(step3) == []


def _damage(checkpoint, how):
    """Delete or cut the files named in ``how`` ("-name": deleted, "~name": cut to half)."""
    listed = json.loads((checkpoint / MANIFEST).read_text())["files"]
    names = sorted(listed) if how == "all" else how
    expected = []
    for entry in names:
        kind, name = ("-", entry) if how == "all" else (entry[0], entry[1:])
        path = checkpoint / name
        if kind == "-":
            path.unlink()
            expected.append(f"{name}: missing")
        else:
            path.write_bytes(path.read_bytes()[: listed[name] // 2])
            expected.append(f"{name}: {listed[name] // 2} bytes, saved with {listed[name]}")
    return expected


DAMAGES = {
    "weights-deleted": ["-model.safetensors"],
    "optimizer-cut": ["~optimizer.bin"],
    "rng-deleted-weights-cut": ["-random_states_0.pkl", "~model.safetensors"],
    "everything-deleted": "all",
}


@pytest.mark.parametrize("how", list(DAMAGES.values()), ids=list(DAMAGES))
def test_auto_passes_over_incomplete_checkpoints_to_the_newest_complete_one_and_says_so(run, how):
    expected = _damage(run / "checkpoints" / "step-3", how)
    chosen, note = _choose(run, "auto")
    assert chosen == run / "checkpoints" / "step-2"
    assert f"{run / 'checkpoints' / 'step-3'} is incomplete" in note
    assert all(problem in note for problem in expected[:5])
    assert f"resuming from the newest complete checkpoint, {run / 'checkpoints' / 'step-2'} (step 2)" in note


def test_auto_refuses_naming_every_checkpoint_when_none_is_complete(run):
    for step in (1, 2, 3):
        _damage(run / "checkpoints" / f"step-{step}", ["-model.safetensors"])
    with pytest.raises(IncompleteCheckpointError) as info:
        _choose(run, "auto")
    message = str(info.value)
    assert all(f"{run / 'checkpoints' / f'step-{s}'} is incomplete (model.safetensors: missing)" in message
               for s in (1, 2, 3))
    assert isinstance(info.value, FileNotFoundError)  # mmtune train prints it as one message


@pytest.mark.parametrize("how", list(DAMAGES.values())[:3], ids=list(DAMAGES)[:3])
def test_a_named_incomplete_checkpoint_is_refused_naming_the_newest_complete_one(run, how):
    expected = _damage(run / "checkpoints" / "step-3", how)
    with pytest.raises(IncompleteCheckpointError) as info:
        _choose(run, str(run / "checkpoints" / "step-3"))
    message = str(info.value)
    assert f"{run / 'checkpoints' / 'step-3'} is incomplete" in message and all(p in message for p in expected)
    assert f"the newest complete checkpoint of this run is {run / 'checkpoints' / 'step-2'} (step 2)" in message


def test_complete_and_unverifiable_checkpoints_are_taken_as_they_are(run):
    assert _choose(run, "auto") == (run / "checkpoints" / "step-3", None)
    assert _choose(run, None) == (None, None)
    (run / "checkpoints" / "step-3" / MANIFEST).unlink()  # saved before manifests: nothing to check against
    assert manifest_problems(run / "checkpoints" / "step-3") is None
    assert _choose(run, str(run / "checkpoints" / "step-3")) == (run / "checkpoints" / "step-3", None)


def test_a_copy_left_between_the_renames_of_an_interrupted_save_is_checked_and_recovered(run):
    import os

    checkpoints = run / "checkpoints"
    os.replace(checkpoints / "step-3", checkpoints / ".tmp-step-3")  # killed between the two renames
    assert _choose(run, "auto")[0] == checkpoints / ".tmp-step-3"
    recover_interrupted_saves(run)
    assert latest_checkpoint(run) == checkpoints / "step-3" and manifest_problems(checkpoints / "step-3") == []
