"""The SFT recipe with ``training.sequence_parallel.size=2`` on 2 gloo ranks (DDP, FSDP2): one group
holds every row, so its data plan is the one-process plan, and the logged losses of three steps
(each after the previous steps' updates) and, under DDP, the first step's gradient equal the
one-process run's. On 4 gloo ranks (SP=2 x 2 data-parallel groups under DDP and FSDP2, SP=4 under
DDP) the groups get the rows one process trains in the same steps, and the losses and final weights
equal its own."""

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


# Four ranks. The tiny LLaVA with 4 key/value heads (its default has 2), so SP=4 can split them;
# batches of 2 padded rows; every run's optimizer step carries 4 micro-batches of the plan: the
# one process accumulates 4, SP=2 x 2 data-parallel groups accumulate 2 per group (rank r of the
# data-parallel world takes the plan's batches r, r + 2, ...), SP=4 (one group) accumulates 4.
_FOUR_RANKS = ("model.architecture.text_config.num_key_value_heads=4", "training.max_steps=3",
               "collator.batch_size=2", "collator.max_length=512", "training.log_sample_ids=true")
# ranks, SP size, accumulation, engine
_LAYOUTS = {"one process": (1, 1, 4, "ddp"), "sp=2 x dp=2": (4, 2, 2, "ddp"), "sp=4": (4, 4, 4, "ddp"),
            "sp=2 x dp=2, fsdp2": (4, 2, 2, "fsdp2")}


def _final_weights(final):
    """The parameters of a saved final/ as the model loads them (the engines write different key layouts)."""
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    model = build_adapter(ModelConfig(family="llava", path=str(final))).load_model()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _four_rank_run(name, tmp_path, synthetic_dir, tiny_overrides):
    nproc, size, accumulation, engine = _LAYOUTS[name]
    out = tmp_path / name.replace(" ", "_").replace("=", "").replace(",", "")
    out.mkdir()
    overrides = tiny_overrides(out / "run", synthetic_dir, *_FOUR_RANKS, f"training.gradient_accumulation_steps={accumulation}",
                               f"training.sequence_parallel.size={size}", f"training.backend.engine={engine}")
    stdout = _run(nproc, out, overrides, "")
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (out / "run" / "sample_ids.jsonl").read_text().splitlines()]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return {"metrics": metrics, "steps": steps, "ranks": ranks, "stdout": stdout,
            "weights": _final_weights(out / "run" / "final")}


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, synthetic_dir):
    from tests.training.conftest import _tiny_overrides

    return _four_rank_run("one process", tmp_path_factory.mktemp("one"), synthetic_dir, _tiny_overrides)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sp=2 x dp=2", "sp=4", "sp=2 x dp=2, fsdp2"])
def test_four_ranks_train_as_one_process_on_the_same_global_batch(layout, one_process_run, tmp_path, synthetic_dir,
                                                                   tiny_overrides):
    one, run = one_process_run, _four_rank_run(layout, tmp_path, synthetic_dir, tiny_overrides)
    _, size, _, _ = _LAYOUTS[layout]
    assert f"sequence parallel: {size} ranks per row" in run["stdout"]
    assert f"{4 // size} data-parallel group(s)" in run["stdout"]
    # the data plan: every rank of a group got the same rows, the groups different ones, and each
    # step's rows over all groups are the one process's rows of that step
    assert len(run["steps"]) == len(one["steps"]) == 3
    for mine, ref in zip(run["steps"], one["steps"]):
        ids = [[i for mb in r["ids"] for i in mb] for r in mine["ranks"]]
        groups = [ids[g * size] for g in range(4 // size)]
        assert all(ids[r] == groups[r // size] for r in range(4)), mine
        assert sorted(i for g in groups for i in g) == sorted(i for mb in ref["ranks"][0]["ids"] for i in mb)
        if len(groups) > 1:
            assert not set(groups[0]) & set(groups[1])
    # the same loss tokens, losses within 1e-5 and the final weights within 1e-5, every rank in sync
    assert [m["train/loss_tokens"] for m in run["metrics"]] == [m["train/loss_tokens"] for m in one["metrics"]]
    for a, b in zip(one["metrics"], run["metrics"]):
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5, (a, b)
    assert len({r["digest"] for r in run["ranks"]}) == 1 and run["ranks"][0]["changed"] > 0
    assert run["weights"].keys() == one["weights"].keys(), set(run["weights"]) ^ set(one["weights"])
    worst = max(float((run["weights"][n] - w).abs().max()) for n, w in one["weights"].items())
    print(f"{layout}: largest final weight difference {worst:.2e}, losses "
          f"{[round(m['train/loss'] - o['train/loss'], 9) for m, o in zip(run['metrics'], one['metrics'])]}")
    assert worst <= 1e-5, worst
