"""Exact resume after SIGKILL: same losses as an uninterrupted run, no sample skipped or repeated."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _start(overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, str(REPO / "recipes" / "sft.py"), *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _lines(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by the kill
            pass
    return rows


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
    reference = _start(tiny_overrides(tmp_path / "reference", synthetic_dir, *common))
    killed_dir = tmp_path / "killed"
    victim = _start(tiny_overrides(killed_dir, synthetic_dir, *common))
    # SIGKILL once a checkpoint exists and training has moved past it.
    deadline = time.time() + 300
    while time.time() < deadline and victim.poll() is None:
        steps = _lines(killed_dir / "sample_ids.jsonl") if (killed_dir / "checkpoints" / "step-3").exists() else []
        if steps and steps[-1]["step"] >= 4:
            victim.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert victim.wait() == -signal.SIGKILL, "the run finished before it could be killed:\n" + victim.stdout.read()
    assert reference.wait(timeout=300) == 0, reference.stdout.read()

    before_kill_metrics = _lines(killed_dir / "metrics.jsonl")
    resumed = _start(tiny_overrides(killed_dir, synthetic_dir, *common))
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output
    resume_step = int(output.split("resumed from ")[1].split("step ")[1].split(",")[0])
    assert resume_step >= 3 and resume_step % 3 == 0
    assert before_kill_metrics[-1]["step"] > resume_step, "the killed attempt should have logged past its checkpoint"

    ids, metrics = _lines(killed_dir / "sample_ids.jsonl"), _lines(killed_dir / "metrics.jsonl")
    reference_dir = tmp_path / "reference"
    ref_ids, ref_metrics = _lines(reference_dir / "sample_ids.jsonl"), _lines(reference_dir / "metrics.jsonl")
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
