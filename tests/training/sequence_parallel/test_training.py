"""The SFT recipe with ``training.sequence_parallel.size=2`` on 2 gloo ranks (DDP, FSDP2): one group
holds every row, so its data plan is the one-process plan, and the logged losses of three steps
(each after the previous steps' updates) and, under DDP, the first step's gradient equal the
one-process run's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.processes import free_port

REPO = Path(__file__).resolve().parents[3]
WORKER = REPO / "tests" / "training" / "dist_worker.py"


def _run(nproc, out, overrides, grads):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if grads:
        env["GRADS_OUT"] = grads
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(WORKER), str(out / "rank{rank}.json"), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_sequence_parallel_ranks_train_as_one_process(engine, tmp_path, synthetic_dir, tiny_overrides):
    runs = {}
    sp = ["training.sequence_parallel.size=2", f"training.backend.engine={engine}"]
    for name, nproc, extra in (("one", 1, []), ("sp", 2, sp)):
        out = tmp_path / name
        out.mkdir()
        overrides = tiny_overrides(out / "run", synthetic_dir, "training.max_steps=3", "training.save_final=false",
                                   "collator.batching=packing", "collator.max_length=512", "collator.batch_size=1",
                                   "training.gradient_accumulation_steps=2", *extra)
        # the worker reads gradients off accelerate's optimizer wrapper: DDP runs only
        grads = str(out / "grads{rank}.pt") if engine == "ddp" else ""
        stdout = _run(nproc, out, overrides, grads)
        metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (metrics, torch.load(out / "grads0.pt") if grads else None, stdout)
    (one, one_grads, _), (sp, sp_grads, stdout) = runs["one"], runs["sp"]
    assert "sequence parallel: 2 ranks per row" in stdout
    assert [m["train/loss_tokens"] for m in sp] == [m["train/loss_tokens"] for m in one] and len(one) == 3
    for a, b in zip(one, sp):
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5, (a, b)
    if engine != "ddp":
        return
    assert one_grads.keys() == sp_grads.keys() and one_grads
    for name in one_grads:
        torch.testing.assert_close(sp_grads[name], one_grads[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_resume_with_sequence_parallelism_repeats_the_uninterrupted_losses(tmp_path, synthetic_dir, tiny_overrides):
    run = tmp_path / "run"
    overrides = tiny_overrides(run, synthetic_dir, "training.max_steps=4", "training.save_every_steps=2",
                               "training.save_final=false", "training.lr=3e-3", "collator.batching=packing",
                               "collator.max_length=512", "collator.batch_size=1",
                               "training.sequence_parallel.size=2")
    _run(2, tmp_path, overrides, "")
    uninterrupted = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in uninterrupted] == [1, 2, 3, 4]
    # again from the step-2 checkpoint: steps 3 and 4 are trained a second time
    _run(2, tmp_path, [*overrides, f"training.resume={run / 'checkpoints' / 'step-2'}"], "")
    resumed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(uninterrupted[2:], resumed[2:]):
        assert a["train/loss_tokens"] == b["train/loss_tokens"]
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-6, (a, b)
