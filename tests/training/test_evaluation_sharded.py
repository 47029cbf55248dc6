"""Benchmark evaluation during training where one rank does not hold the whole model: FSDP2 on 2 gloo
ranks and sequence parallelism (SP=2) on 2 processes, and ZeRO-3 in one process. The synthetic
benchmark's answers and scores logged by the run equal those of one process: the one-process
evaluation of the run's own final/ (the same weights) answers every turn alike, and (FSDP2, SP) a
one-process DDP training run of the same steps logs the same scores. ZeRO-3 on several processes
gathers the weights the same way (deepspeed.zero.GatheredParameters) but needs GPUs: DeepSpeed's
collectives do not run on CPU ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")


def _train(nproc: int, tmp_path: Path, overrides: list[str], **env: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(WORKER), str(tmp_path / "rank{rank}.json"), *overrides]
    if nproc == 1 and env:  # DeepSpeed in one plain process
        cmd = [sys.executable, str(WORKER), str(tmp_path / "rank{rank}.json"), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                               "TOKENIZERS_PARALLELISM": "false", **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]


def _one_process_evaluation(final: Path, synthetic_dir: Path, out: Path) -> tuple[str, dict]:
    from mmtune.evaluation.config import EvalConfig, GenerationConfig
    from mmtune.evaluation.runner import evaluate_checkpoint

    cfg = EvalConfig(benchmarks=["synthetic"], progress=False, generation=GenerationConfig(max_new_tokens=8, batch_size=2))
    cfg.synthetic.data_path, cfg.synthetic.image_root = str(synthetic_dir / "test.json"), str(synthetic_dir / "images")
    results = evaluate_checkpoint(str(final), cfg, output_dir=str(out))
    return (out / "generations" / "synthetic.jsonl").read_text(), results["synthetic"].metrics


LAYOUTS = {
    "fsdp2": (2, ["training.backend.engine=fsdp2"], {}),
    "sp2": (2, ["training.sequence_parallel.size=2"], {}),
    "fsdp2_sp2": (2, ["training.backend.engine=fsdp2", "training.sequence_parallel.size=2"], {}),
    "zero3": (1, ["training.backend.engine=deepspeed", "training.backend.deepspeed.stage=3"],
              {"DS_ACCELERATOR": "cpu", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_evaluation_after_training_scores_as_one_process(layout, tmp_path, synthetic_dir, tiny_overrides):
    nproc, extra, env = LAYOUTS[layout]
    if env:
        env = {**env, "MASTER_PORT": str(free_port())}
    common = ("training.max_steps=2", "training.eval_after=true", "eval.generation.batch_size=2")
    run = tmp_path / "run"
    _train(nproc, tmp_path, tiny_overrides(run, synthetic_dir, *common, *extra), **env)
    after = run / "eval" / "after"
    result = json.loads((after / "synthetic.json").read_text())
    if nproc > 1:  # both ranks generated their share, on the full weights
        ranks = result["meta"]["data_parallel"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["turns"] > 0 for r in ranks)
    generations, metrics = _one_process_evaluation(run / "final", synthetic_dir, tmp_path / "one_eval")
    assert (after / "generations" / "synthetic.jsonl").read_text() == generations
    assert result["metrics"] == metrics
    if layout == "zero3":  # DeepSpeed's own optimizer step: its weights differ from DDP's in the last bits
        return
    # a one-process training run of the same two steps logs the same scores
    single = tmp_path / "single"
    single.mkdir()
    _train(1, single, tiny_overrides(single / "run", synthetic_dir, *common))
    assert json.loads((single / "run" / "eval" / "after" / "synthetic.json").read_text())["metrics"] == metrics
