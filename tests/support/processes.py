"""Tests that run mmtune in child processes: a free port, the SFT recipe killed and resumed,
and the one-process ZeRO-3 loss worker.

Test tooling, outside the installed package (see :mod:`tests.support.fake_judge`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[2]
ZERO3_LOSS_WORKER = REPO / "tests" / "training" / "zero3_loss_worker.py"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL log; none when it does not exist, and a line torn by a kill is left out."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def start_sft(overrides: list[str]) -> subprocess.Popen:
    """``recipes/sft.py`` with ``overrides`` in a child process, its output in ``stdout``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, str(REPO / "recipes" / "sft.py"), *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@dataclass
class KilledAndResumed:
    """An SFT run SIGKILLed past its step-3 checkpoint and resumed, beside the same run uninterrupted."""

    killed_dir: Path
    reference_dir: Path
    resume_step: int
    before_kill_metrics: list[dict]
    """``metrics.jsonl`` of the killed attempt, read before the resume cut it back."""


def kill_and_resume(tmp_path: Path, data_dir: Path, tiny_overrides: Callable[..., list[str]],
                    common: tuple[str, ...]) -> KilledAndResumed:
    """Run ``common`` twice side by side (``tmp_path/reference``, ``tmp_path/killed``), SIGKILL
    the second once ``checkpoints/step-3`` exists and the metrics line of step 4 is written
    (each step's sample ids are logged before its metrics), then resume it to the end."""
    reference = start_sft(tiny_overrides(tmp_path / "reference", data_dir, *common))
    killed_dir = tmp_path / "killed"
    victim = start_sft(tiny_overrides(killed_dir, data_dir, *common))
    deadline = time.time() + 300
    while time.time() < deadline and victim.poll() is None:
        steps = read_jsonl(killed_dir / "metrics.jsonl") if (killed_dir / "checkpoints" / "step-3").exists() else []
        if steps and steps[-1]["step"] >= 4:
            victim.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert victim.wait() == -signal.SIGKILL, "the run finished before it could be killed:\n" + victim.stdout.read()
    assert reference.wait(timeout=300) == 0, reference.stdout.read()
    before_kill_metrics = read_jsonl(killed_dir / "metrics.jsonl")
    resumed = start_sft(tiny_overrides(killed_dir, data_dir, *common))
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output
    resume_step = int(output.split("resumed from ")[1].split("step ")[1].split(",")[0])
    return KilledAndResumed(killed_dir, tmp_path / "reference", resume_step, before_kill_metrics)


def zero3_loss(out: Path, overrides: list[str]) -> dict:
    """One forward/backward under one-process ZeRO-3 on CPU (``zero3_loss_worker.py``): loss and gathered grads."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(ZERO3_LOSS_WORKER), str(out), *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)
