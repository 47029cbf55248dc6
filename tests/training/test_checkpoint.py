"""Atomic, keep-last-N resumable checkpoints and the final HF checkpoint."""

import json

import torch
from accelerate import Accelerator

from mmtune.training.checkpoint import (
    TRAINER_STATE,
    CheckpointManager,
    latest_checkpoint,
    read_trainer_state,
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
