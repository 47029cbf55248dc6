"""Atomic, keep-last-N resumable checkpoints and the final HF checkpoint; saves killed at any point."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from mmtune.training.checkpoint import (
    RUN_METADATA,
    SAVE_POINTS,
    TRAINER_STATE,
    CheckpointManager,
    latest_checkpoint,
    read_trainer_state,
    recover_interrupted_saves,
    write_json_atomic,
)


def _tiny_setup():
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _step(model, optimizer):
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_keep_last_and_latest(tmp_path):
    accelerator, model, optimizer = _tiny_setup()
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _step(model, optimizer)
        manager.save(accelerator, step, {"epoch": 0, "micro_batches_done": step})
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-2", "step-3"]
    assert latest_checkpoint(tmp_path).name == "step-3"
    assert read_trainer_state(latest_checkpoint(tmp_path)) == {"epoch": 0, "micro_batches_done": 3, "step": 3}


def test_crash_mid_write_leaves_previous_checkpoint_usable(tmp_path):
    accelerator, model, optimizer = _tiny_setup()
    manager = CheckpointManager(tmp_path, keep_last=3)
    _step(model, optimizer)
    manager.save(accelerator, 1, {"epoch": 0, "micro_batches_done": 1})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    # A crash while step 2 was being written: a partial temporary directory, no trainer state.
    partial = tmp_path / "checkpoints" / ".tmp-step-2"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    assert latest_checkpoint(tmp_path).name == "step-1"
    # Resuming from it restores the weights; the next save clears the debris.
    _step(model, optimizer)
    manager.load(accelerator, latest_checkpoint(tmp_path))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[key])
    manager.save(accelerator, 2, {"epoch": 0, "micro_batches_done": 2})
    assert not partial.exists() and (tmp_path / "checkpoints" / "step-2" / TRAINER_STATE).is_file()


def test_write_json_atomic_replaces_whole_file(tmp_path):
    target = tmp_path / "state.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


WORKER = Path(__file__).with_name("save_worker.py")
REPO = Path(__file__).resolve().parents[2]
# (scenario, point, version found afterwards). Once the new copy is complete (its marker
# written) it is what is found unless the old copy still holds the same name.
_KILLS = [
    ("resave", "written", "A"), ("resave", "old_moved_aside", "B"), ("resave", "new_in_place", "B"),
    ("resave", "old_deleted", "B"), ("resave", "pruned", "B"),
    ("next", "written", "B"), ("next", "new_in_place", "B"), ("next", "old_deleted", "B"), ("next", "pruned", "B"),
    ("final", "written", "A"), ("final", "old_moved_aside", "B"), ("final", "new_in_place", "B"),
    ("final", "old_deleted", "B"),
]
# The window between the renames, where deleting before swapping used to lose the copy,
# runs by default; every other point with the slow tests.
_DEFAULT = {("resave", "old_moved_aside"), ("final", "old_moved_aside")}


@pytest.mark.parametrize("scenario,point,version", [
    pytest.param(*kill, marks=() if kill[:2] in _DEFAULT else pytest.mark.slow, id=f"{kill[0]}-{kill[1]}")
    for kill in _KILLS])
def test_a_save_killed_at_any_point_leaves_a_complete_checkpoint(tmp_path, scenario, point, version):
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), scenario, point], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    expected = torch.load(tmp_path / "expected.pt")[version]
    if scenario == "final":
        recover_interrupted_saves(tmp_path)
        found = tmp_path / "final"
        assert json.loads((found / RUN_METADATA).read_text())["version"] == version
    else:
        # Found as is (even between the renames), and in place after recovery.
        found = latest_checkpoint(tmp_path)
        assert read_trainer_state(found)["version"] == version
        recover_interrupted_saves(tmp_path)
        found = latest_checkpoint(tmp_path)
        assert found.name == "step-2"
        assert read_trainer_state(found)["version"] == version
    weights = load_file(str(found / "model.safetensors"))
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value)
    assert not list(found.parent.glob(".old-*"))


def test_resaving_never_deletes_the_old_copy_first(tmp_path):
    accelerator, model, optimizer = _tiny_setup()
    seen = []

    def look(point):
        complete = [p.name for p in (tmp_path / "checkpoints").iterdir() if (p / TRAINER_STATE).is_file()]
        seen.append((point, sorted(complete)))

    manager = CheckpointManager(tmp_path, keep_last=2, on_save_point=look)
    manager.save(accelerator, 2, {"epoch": 0, "micro_batches_done": 1})
    _step(model, optimizer)
    manager.save(accelerator, 2, {"epoch": 0, "micro_batches_done": 2})
    assert [point for point, _ in seen[-5:]] == list(SAVE_POINTS)
    assert all(names for _, names in seen)  # at every point some complete copy of step 2 exists
    assert read_trainer_state(latest_checkpoint(tmp_path))["micro_batches_done"] == 2


def _demo_config() -> dict:
    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import _to_dict

    cfg = _to_dict(to_sft_config(compose_sft_config(["experiment=demo_single_image", "peft=lora"])))
    return json.loads(json.dumps(cfg))


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, "other"]
    if isinstance(value, dict):  # an empty one is a family's section without settings: it can only go away
        return {**value, "other": 1} if value else None
    return "other"  # None


def _set(config: dict, dotted: str, value) -> dict:
    import copy
    import re

    config = copy.deepcopy(config)
    parts = [p for p in re.split(r"\.|\[(\d+)\]", dotted) if p]
    node = config
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node[part]
    node[parts[-1]] = value
    return config


def test_every_config_key_is_either_free_to_change_on_resume_or_refused_unless_allowed():
    from mmtune.training.checkpoint import (RESUME_FREE_KEYS, ResumeConfigError, check_resume_config,
                                            flatten_config, key_covers)

    saved = _demo_config()
    keys = flatten_config(saved)
    assert "data.mixture.sources[0].path" in keys and "training.projector.lr" in keys
    free = refused = 0
    for key, value in keys.items():
        current = _set(saved, key, _changed(value))
        state = {"step": 4, "config": saved}
        if any(key_covers(f, key) for f in RESUME_FREE_KEYS):
            assert check_resume_config("ckpt", state, current, []) == {}, key
            free += 1
            continue
        with pytest.raises(ResumeConfigError, match=rf"(?m)^  - {re.escape(key)}: .* -> "):
            check_resume_config("ckpt", state, current, [])
        # Allowed by its own name or by a parent's, it is returned to be recorded.
        parent = key.split(".")[0]
        for allowed in ([key], [parent]):
            assert check_resume_config("ckpt", state, current, allowed) == {
                key: {"old": value, "new": _changed(value)}}, (key, allowed)
        refused += 1
    assert free and refused > 50
    unused = [f for f in RESUME_FREE_KEYS if not any(key_covers(f, key) for key in keys)]
    assert not unused, f"free keys that name no config key: {unused}"


def test_resume_config_check_names_keys_missing_on_one_side_and_quotes_indexed_keys():
    from mmtune.training.checkpoint import ResumeConfigError, check_resume_config

    saved = _demo_config()
    older = json.loads(json.dumps(saved))
    del older["training"]["adam_epsilon"]  # a key this version adds
    current = _set(saved, "data.mixture.sources[0].path", "/elsewhere/train.json")
    with pytest.raises(ResumeConfigError) as info:
        check_resume_config("ckpt", {"step": 2, "config": older}, current, [])
    message = str(info.value)
    assert "training.adam_epsilon: (not set) -> 1e-08" in message
    assert "data.mixture.sources[0].path: " in message and "-> '/elsewhere/train.json'" in message
    assert """'training.resume_config_changes=["data.mixture.sources[0].path",training.adam_epsilon]'""" in message
    # Lengthening the run is allowed only explicitly, and the message says what it does to the schedule.
    with pytest.raises(ResumeConfigError, match="reshapes the learning-rate schedule"):
        check_resume_config("ckpt", {"step": 2, "config": saved}, _set(saved, "training.max_steps", 100), [])


def test_an_unknown_key_in_resume_config_changes_is_refused_at_start_up():
    from mmtune.training.config import ConfigError, to_sft_config
    from mmtune.training.demo import compose_sft_config

    with pytest.raises(ConfigError, match=r"resume_config_changes: 'training.lerning_rate' names no config key"):
        to_sft_config(compose_sft_config(["experiment=demo_single_image",
                                          "training.resume_config_changes=[training.lr,training.lerning_rate]"]))
    to_sft_config(compose_sft_config(["experiment=demo_single_image",
                                      "training.resume_config_changes=[training.projector,'data.mixture.sources[0]']"]))


# How a full disk reaches mmtune from each writer: a plain write, a quota, safetensors
# (Rust's error text, no errno) and torch's zip writer (a short write, no errno).
DISK_FULL = {
    "enospc": lambda: OSError(errno.ENOSPC, "No space left on device"),
    "quota": lambda: OSError(errno.EDQUOT, "Disk quota exceeded"),
    "safetensors": lambda: Exception("Error while serializing: I/O error: No space left on device (os error 28)"),
    "torch_zip": lambda: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 420736 vs 420624"),
}


def _fill_disk_at(monkeypatch, marker: str, error):
    """``torch.save`` into a path containing ``marker`` writes a few bytes, then fails with ``error``."""
    real_save = torch.save

    def full(obj, f, *args, **kwargs):
        if marker in str(f):
            Path(f).write_bytes(b"partial")
            raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full)


@pytest.mark.parametrize("kind", sorted(DISK_FULL))
def test_a_full_disk_during_a_checkpoint_names_the_path_and_keeps_the_last_one_intact(tmp_path, monkeypatch, kind):
    from mmtune.io.disk import DiskFullError

    accelerator, model, optimizer = _tiny_setup()
    manager = CheckpointManager(tmp_path, keep_last=1)
    _step(model, optimizer)
    manager.save(accelerator, 1, {"epoch": 0, "micro_batches_done": 1})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, optimizer)
    _fill_disk_at(monkeypatch, ".tmp-step-2", DISK_FULL[kind]())  # model weights written, optimizer state not
    with pytest.raises(DiskFullError) as info:
        manager.save(accelerator, 2, {"epoch": 0, "micro_batches_done": 2})
    message = str(info.value)
    assert f"no space left on the device holding {tmp_path / 'checkpoints' / '.tmp-step-2'}" in message
    assert "while writing checkpoint step 2" in message and " free of " in message
    assert f"The last complete checkpoint, {tmp_path / 'checkpoints' / 'step-1'} (step 1), is intact" in message
    assert "training.resume=auto" in message and "How to fix: free space" in message
    assert info.value.errno == errno.ENOSPC and isinstance(info.value.__cause__, type(DISK_FULL[kind]()))
    # The partial copy is gone (its space given back); step 1 is complete and restores its weights.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    monkeypatch.undo()
    manager.load(accelerator, latest_checkpoint(tmp_path))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[key])
    assert manager.save(accelerator, 2, {"epoch": 0, "micro_batches_done": 2}).name == "step-2"


def test_other_write_errors_pass_through_unchanged(tmp_path, monkeypatch):
    accelerator, model, optimizer = _tiny_setup()
    _fill_disk_at(monkeypatch, ".tmp-step-1", PermissionError(errno.EACCES, "Permission denied"))
    with pytest.raises(PermissionError):
        CheckpointManager(tmp_path).save(accelerator, 1, {})


@pytest.mark.parametrize("kind", ["enospc", "safetensors"])
def test_a_full_disk_during_the_final_save_keeps_the_previous_final_and_checkpoint(tmp_path, kind):
    from mmtune.io.disk import DiskFullError
    from mmtune.training.checkpoint import save_final
    from tests.training.save_worker import TinyPretrained

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(TinyPretrained())
    CheckpointManager(tmp_path).save(accelerator, 3, {"epoch": 0})
    save_final(accelerator, model, tmp_path / "final", save_pretrained_extras=[], metadata={"version": "A"})

    def full(path, state_dict=None, safe_serialization=True):
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        raise DISK_FULL[kind]()

    model.save_pretrained = full
    with pytest.raises(DiskFullError) as info:
        save_final(accelerator, model, tmp_path / "final", save_pretrained_extras=[], metadata={"version": "B"})
    message = str(info.value)
    assert f"{tmp_path / '.tmp-final'} while writing the final checkpoint" in message
    assert f"{tmp_path / 'final'} was not replaced. The previous final/ is intact." in message
    assert f"{tmp_path / 'checkpoints' / 'step-3'} (step 3), is intact" in message
    assert json.loads((tmp_path / "final" / RUN_METADATA).read_text()) == {"version": "A"}
    assert not (tmp_path / ".tmp-final").exists()


def test_checkpoint_and_final_weights_are_readable_like_every_other_file(tmp_path):
    """safetensors writes 0600 whatever the umask; a checkpoint another account (a server,
    a container user) reads must follow the umask like config.json does."""
    from mmtune.training.checkpoint import save_final
    from tests.training.save_worker import TinyPretrained

    old = os.umask(0o022)
    try:
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(TinyPretrained())
        CheckpointManager(tmp_path).save(accelerator, 1, {"epoch": 0})
        save_final(accelerator, model, tmp_path / "final", save_pretrained_extras=[], metadata={"version": "A"})
    finally:
        os.umask(old)
    weights = sorted(tmp_path.rglob("*.safetensors"))
    assert {p.parent.name for p in weights} >= {"final", "step-1"}
    for path in [*weights, tmp_path / "final" / RUN_METADATA, tmp_path / "checkpoints" / "step-1" / TRAINER_STATE]:
        assert path.stat().st_mode & 0o777 == 0o644, path
