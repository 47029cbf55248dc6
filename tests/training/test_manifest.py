"""Checkpoints carry a manifest; a resume checks it, falls back to the newest complete one or
refuses, naming both."""

import json

import pytest
import torch
from accelerate import Accelerator

from mmtune.training.checkpoint import (TRAINER_STATE, CheckpointManager, complete_checkpoints, latest_checkpoint,
                                       read_trainer_state, recover_interrupted_saves)
from mmtune.training.manifest import (HASHES, MANIFEST, IncompleteCheckpointError, choose_resume_checkpoint,
                                      file_hash, manifest_problems, verify_checkpoint)


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
    assert listed == {k: v for k, v in on_disk.items() if k != MANIFEST}  # the marker's from the bytes it wrote
    assert "model.safetensors" in listed and TRAINER_STATE in listed and len(listed) >= 4
    hashes = json.loads((step3 / MANIFEST).read_text())["hashes"]
    name = json.loads((step3 / MANIFEST).read_text())["hash"]
    assert hashes == {k: file_hash(step3 / k, name) for k in listed}
    assert manifest_problems(step3) == []


def _damage(checkpoint, how):
    """Delete or cut the files named in ``how`` ("-name": deleted, "~name": cut to half)."""
    listed = json.loads((checkpoint / MANIFEST).read_text())["files"]
    names = sorted(set(listed) - {TRAINER_STATE}) if how == "all" else how  # without its marker: not a checkpoint
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
    assert f"resuming from the newest intact checkpoint, {run / 'checkpoints' / 'step-2'} (step 2)" in note


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
    assert f"the newest intact checkpoint of this run is {run / 'checkpoints' / 'step-2'} (step 2)" in message


def test_complete_and_unverifiable_checkpoints_are_taken_as_they_are(run):
    assert _choose(run, "auto") == (run / "checkpoints" / "step-3", None)
    assert _choose(run, None) == (None, None)
    (run / "checkpoints" / "step-3" / MANIFEST).unlink()  # saved before manifests: nothing to check against
    assert manifest_problems(run / "checkpoints" / "step-3") is None
    chosen, note = _choose(run, str(run / "checkpoints" / "step-3"))
    assert chosen == run / "checkpoints" / "step-3" and "has no manifest.json (saved by an older mmtune)" in note


def test_a_copy_left_between_the_renames_of_an_interrupted_save_is_checked_and_recovered(run):
    import os

    checkpoints = run / "checkpoints"
    os.replace(checkpoints / "step-3", checkpoints / ".tmp-step-3")  # killed between the two renames
    assert _choose(run, "auto")[0] == checkpoints / ".tmp-step-3"
    recover_interrupted_saves(run)
    assert latest_checkpoint(run) == checkpoints / "step-3" and manifest_problems(checkpoints / "step-3") == []


# -- content: a file overwritten in place keeps its size ------------------------------------------


def _overwrite(path, how):
    """Damage ``path`` in place, its size kept: random bytes, a zeroed half, one flipped byte."""
    import os

    data = bytearray(path.read_bytes())
    if how == "random":
        start = len(data) // 4
        data[start:start + 65536] = os.urandom(len(data[start:start + 65536]))
    elif how == "zeroed-half":
        data[len(data) // 2:] = bytes(len(data) - len(data) // 2)
    elif how == "header":
        data[:8] = os.urandom(8)
    else:  # one flipped byte in the middle
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _listed(checkpoint):
    return sorted(json.loads((checkpoint / MANIFEST).read_text())["files"])


@pytest.mark.parametrize("how", ["random", "zeroed-half", "header", "one-byte"])
def test_any_file_overwritten_in_place_is_named_and_auto_resumes_from_the_newest_intact_one(run, how):
    step3, step2 = run / "checkpoints" / "step-3", run / "checkpoints" / "step-2"
    for name in _listed(step3):  # every file a checkpoint has, the marker and the RNG states included
        saved = (step3 / name).read_bytes()
        _overwrite(step3 / name, how)
        assert (step3 / name).stat().st_size == len(saved)
        problems = manifest_problems(step3)
        assert len(problems) == 1 and problems[0].startswith(f"{name}: content changed since it was saved"), name
        chosen, note = _choose(run, "auto")
        assert chosen == step2, name
        assert f"{step3} is damaged ({name}: content changed" in note
        assert f"resuming from the newest intact checkpoint, {step2} (step 2), instead" in note
        with pytest.raises(IncompleteCheckpointError, match=f"newest intact checkpoint of this run is {step2}"):
            _choose(run, str(step3))
        (step3 / name).write_bytes(saved)
    assert manifest_problems(step3) == []


def test_a_damaged_manifest_is_named_and_passed_over(run):
    step3 = run / "checkpoints" / "step-3"
    (step3 / MANIFEST).write_bytes(b"\x00" * 40)
    chosen, note = _choose(run, "auto")
    assert chosen == run / "checkpoints" / "step-2" and f"{step3} is damaged ({MANIFEST}: unreadable" in note


def test_a_manifest_saved_before_hashes_is_checked_by_size_and_the_resume_says_so(run):
    step3 = run / "checkpoints" / "step-3"
    manifest = json.loads((step3 / MANIFEST).read_text())
    (step3 / MANIFEST).write_text(json.dumps({"files": manifest["files"]}))
    _overwrite(step3 / "model.safetensors", "one-byte")  # not seen: nothing recorded to compare with
    chosen, note = _choose(run, "auto")
    assert chosen == step3 and "saved before checkpoints recorded content hashes: checked by file size only" in note
    assert verify_checkpoint(step3)[0] == []


def test_the_fallback_hash_is_used_where_xxhash_is_missing(run, monkeypatch):
    import hashlib

    assert set(HASHES) == {"xxh3_128", "blake2b-128"}
    path = run / "checkpoints" / "step-3" / "model.safetensors"
    assert file_hash(path, "blake2b-128") == hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()

    def missing():
        raise ImportError("No module named 'xxhash'")

    monkeypatch.setitem(HASHES, "xxh3_128", missing)
    assert file_hash(path) == file_hash(path, "blake2b-128")


@pytest.mark.parametrize("name", ["optimizer.bin", "model.safetensors"])
def test_a_checkpoint_that_fails_to_load_is_one_message_naming_it_and_an_older_one(run, name):
    step3 = run / "checkpoints" / "step-3"
    manifest = json.loads((step3 / MANIFEST).read_text())
    (step3 / MANIFEST).write_text(json.dumps({"files": manifest["files"]}))  # an older, size-only manifest
    _overwrite(step3 / name, "header")
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(4, 2), torch.optim.AdamW(torch.nn.Linear(4, 2).parameters()))
    with pytest.raises(IncompleteCheckpointError) as info:
        CheckpointManager(run, keep_last=3).load(accelerator, step3)
    assert f"cannot resume: {step3} failed to load (" in str(info.value)
    assert f"training.resume={run / 'checkpoints' / 'step-2'}" in str(info.value)
