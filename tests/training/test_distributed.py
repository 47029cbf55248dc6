"""Distributed training on CPU: 2 ranks with torchrun + gloo, and DeepSpeed ZeRO-2/3 in one process."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


@pytest.mark.slow
def test_two_ranks_shard_data_without_overlap_and_stay_in_sync(tmp_path, synthetic_dir, tiny_overrides):
    out = tmp_path / "run"
    overrides = tiny_overrides(out, synthetic_dir, "training.max_steps=4", "training.log_sample_ids=true",
                               "training.save_final=false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(WORKER), str(tmp_path / "rank{rank}.json"), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["steps"] == 4
    # Gradients were all-reduced: both ranks hold identical weights, and training changed them.
    assert ranks[0]["digest"] == ranks[1]["digest"] and ranks[0]["changed"] > 0
    steps = [json.loads(line) for line in (out / "sample_ids.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    seen = {0: [], 1: []}
    for step in steps:
        assert [r["rank"] for r in step["ranks"]] == [0, 1]
        for r in step["ranks"]:
            seen[r["rank"]] += [i for mb in r["ids"] for i in mb]
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])
    assert len(seen[0] + seen[1]) == len(set(seen[0] + seen[1])) == 32  # one epoch, every sample once


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_on_cpu_trains_and_saves_a_loadable_hf_checkpoint(stage, tmp_path, synthetic_dir,
                                                                         tiny_overrides):
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    out = tmp_path / "run"
    overrides = tiny_overrides(out, synthetic_dir, "training.max_steps=3", "training.lr=1e-2",
                               f"training.deepspeed_config={REPO}/launch/deepspeed/zero{stage}.json")
    env = _env(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "rank{rank}.json"), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "rank0.json").read_text())["steps"] == 3
    # final/ is a plain HF checkpoint with full (gathered) tensors, not DeepSpeed shards.
    final = out / "final"
    assert (final / "model.safetensors").is_file() and not list(final.glob("*.pt"))
    trained = build_adapter(ModelConfig(family="llava", path=str(final))).load_model()
    initial = build_adapter(ModelConfig(family="llava")).load_model(seed=0)  # the demo's seed
    trained_params, initial_params = dict(trained.named_parameters()), dict(initial.named_parameters())
    assert trained_params.keys() == initial_params.keys()
    assert all(trained_params[n].shape == p.shape for n, p in initial_params.items())
    changed = [n for n, p in initial_params.items() if not torch.equal(trained_params[n], p)]
    assert any(".language_model." in n for n in changed) and any(".multi_modal_projector." in n for n in changed)
