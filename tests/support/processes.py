"""Tests that run mmtune in child processes: a free port, the SFT recipe under torchrun or killed
and resumed, the weights of its ``final/``, and the one-process ZeRO-3 loss worker.

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
SFT = str(REPO / "recipes" / "sft.py")
ZERO3_LOSS_WORKER = REPO / "tests" / "training" / "zero3_loss_worker.py"


def child_env() -> dict:
    """The environment of an mmtune child process: one thread per process, no hub."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def torchrun(ranks: int) -> list[str]:
    """``torchrun --nproc_per_node <ranks> recipes/sft.py`` on a free port (append the overrides)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port()), SFT]


def run_ok(cmd: list[str]) -> str:
    """Run ``cmd`` in the repository to its end, which must succeed; its stdout and stderr."""
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def final_weights(final: Path, family: str) -> dict[str, torch.Tensor]:
    """The parameters of a run's ``final/`` checkpoint, loaded as the family's model."""
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    model = build_adapter(ModelConfig(family=family, path=str(final))).load_model()
    return {n: p.detach() for n, p in model.named_parameters()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> float:
    """Assert the same names and every tensor within ``atol``; returns the largest difference."""
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)
    return max(float((a[name].float() - b[name].float()).abs().max()) for name in a)


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


def step_sample_ids(run: Path) -> list[list[str]]:
    """Each logged step's sample ids over its ranks and micro-batches, in the order of the epoch's plan
    (rank r of W takes the plan's batches r, r + W, ...), so runs on other rank layouts compare."""
    return [[i for r in s["ranks"] for mb in r["ids"] for i in mb] for s in read_jsonl(run / "sample_ids.jsonl")]


def start_sft(overrides: list[str]) -> subprocess.Popen:
    """``recipes/sft.py`` with ``overrides`` in a child process, its output in ``stdout``."""
    return subprocess.Popen([sys.executable, SFT, *overrides], cwd=REPO, env=child_env(),
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
