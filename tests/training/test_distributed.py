"""Distributed training on CPU: 2 ranks with torchrun + gloo, and DeepSpeed ZeRO-2/3 in one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.processes import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


@pytest.mark.slow
def test_two_ranks_shard_data_without_overlap_and_stay_in_sync(tmp_path, synthetic_dir, tiny_overrides):
    out = tmp_path / "run"
    overrides = tiny_overrides(out, synthetic_dir, "training.max_steps=4", "training.log_sample_ids=true",
                               "training.save_final=false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
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
def test_every_rank_of_a_second_job_stops_naming_the_folders_holder(tmp_path, synthetic_dir, tiny_overrides):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mmtune.io.locks import lock_directory; "
                               "lock_directory(sys.argv[1], purpose='training'); print('locked', flush=True); "
                               "time.sleep(900)", str(out)], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(WORKER), str(tmp_path / "rank{rank}.json"),
               *tiny_overrides(out, synthetic_dir, "training.max_steps=1")]
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    finally:
        holder.kill()
        holder.wait()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # Both ranks raise the same refusal (rank 1 learns it from rank 0 instead of waiting at a barrier).
    assert output.count(f"in use by another process: pid {holder.pid}") >= 2, output[-4000:]
    assert not (out / "data_report.json").exists()


# Packing into 512-token rows over windows of 8 samples: 13 rows per epoch, so a plain
# round-robin would give rank 0 seven micro-batches and rank 1 six.
_UNEVEN_PACKING = ("collator.batching=packing", "collator.batch_size=1", "collator.max_length=512",
                   "collator.packing_window=8")


@pytest.mark.slow
def test_two_ranks_stay_in_step_on_uneven_packed_plans_with_the_token_weighted_gradient(tmp_path, synthetic_dir,
                                                                                          tiny_overrides):
    from mmtune.data.datamodule import SFTDataModule
    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe
    from mmtune.training.loss import materialized_cross_entropy_sum

    out = tmp_path / "run"
    overrides = tiny_overrides(out, synthetic_dir, *_UNEVEN_PACKING, "training.epochs=2",
                               "training.gradient_accumulation_steps=2", "training.max_grad_norm=null",
                               "training.log_sample_ids=true", "training.save_final=false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(WORKER), str(tmp_path / "rank{rank}.json"), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(GRADS_OUT=str(tmp_path / "grads{rank}.pt")), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    # The reference: one process over the union of both ranks' first-step micro-batches.
    cfg = to_sft_config(compose_sft_config(tiny_overrides(tmp_path / "reference", synthetic_dir, *_UNEVEN_PACKING,
                                                          "training.max_grad_norm=null")))
    recipe = SFTRecipe(cfg)
    recipe.setup()
    shares = []
    for rank in (0, 1):
        dm = SFTDataModule(cfg.data, cfg.collator, seed=cfg.training.seed)
        dm.connect(recipe.adapter, rank=rank, world_size=2, gradient_accumulation_steps=2)
        dm.setup()
        shares.append(dm)
    real = [shares[r].rank_plan(e).real for e in range(2) for r in (0, 1)]
    assert real[0] != real[1], "the plan should deal the ranks unequal numbers of micro-batches"

    # In step: both ranks ran the same micro-batches and steps (the short rank padded with a filler).
    per_rank = shares[0].num_micro_batches(0) + shares[0].num_micro_batches(1)
    assert ranks[0]["steps"] == ranks[1]["steps"] == per_rank // 2
    assert ranks[0]["micro_batches"] == ranks[1]["micro_batches"] == per_rank
    assert ranks[0]["fillers"] != ranks[1]["fillers"]
    assert ranks[0]["digest"] == ranks[1]["digest"] and ranks[0]["changed"] > 0
    # Every sample exactly once per epoch, across both ranks.
    steps = [json.loads(line) for line in (out / "sample_ids.jsonl").read_text().splitlines()]
    for epoch in (0, 1):
        ids = [i for s in steps if s["epoch"] == epoch for r in s["ranks"] for mb in r["ids"] for i in mb]
        assert len(ids) == len(set(ids)) == 32, (epoch, sorted(ids))

    # The all-reduced gradient of step 1 is that of the token-weighted mean over both ranks' batches.
    micro = [item for dm in shares for item, _ in zip(dm.dataloader(0), range(2))]
    tokens_per_rank = [sum(int(b["num_loss_tokens"]) for b, _ in micro[:2]),
                       sum(int(b["num_loss_tokens"]) for b, _ in micro[2:])]
    assert tokens_per_rank[0] != tokens_per_rank[1]
    model = recipe.accelerator.unwrap_model(recipe.model)
    inputs = ("input_ids", "attention_mask", "position_ids", "pixel_values")
    loss = sum(materialized_cross_entropy_sum(model(**{k: b[k] for k in inputs}, use_cache=False).logits, b["labels"])
               for b, _ in micro)
    (loss / sum(tokens_per_rank)).backward()
    grads = [torch.load(tmp_path / f"grads{r}.pt") for r in (0, 1)]
    checked = 0
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(grads[0][name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(grads[1][name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
            checked += 1
    assert checked > 0
    recipe.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_on_cpu_trains_and_saves_a_loadable_hf_checkpoint(stage, tmp_path, synthetic_dir,
                                                                         tiny_overrides):
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    out = tmp_path / "run"
    overrides = tiny_overrides(out, synthetic_dir, "training.max_steps=3", "training.lr=1e-2",
                               "training.backend.engine=deepspeed", f"training.backend.deepspeed.stage={stage}",
                               f"training.backend.deepspeed.config_file={REPO}/launch/deepspeed/zero{stage}.json")
    env = _env(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "rank{rank}.json"), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "rank0.json").read_text())["steps"] == 3
    # The engine's gradient norm is logged under DeepSpeed too.
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["train/grad_norm"] > 0 for m in metrics)
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


@pytest.mark.slow
def test_two_ranks_share_the_evaluation_after_training_and_match_one_process(tmp_path, synthetic_dir, tiny_overrides):
    from mmtune.evaluation.config import EvalConfig, GenerationConfig
    from mmtune.evaluation.runner import evaluate_checkpoint

    out = tmp_path / "run"
    overrides = tiny_overrides(out, synthetic_dir, "training.max_steps=2", "training.eval_after=true",
                               "eval.generation.batch_size=2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(WORKER), str(tmp_path / "rank{rank}.json"), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = out / "eval" / "after"
    result = json.loads((after / "synthetic.json").read_text())
    ranks = result["meta"]["data_parallel"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["turns"] > 0 for r in ranks)  # both ranks generated
    # the saved final/ evaluated by one process answers the same
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False, generation=GenerationConfig(max_new_tokens=8, batch_size=2))
    cfg.synthetic.data_path, cfg.synthetic.image_root = str(synthetic_dir / "test.json"), str(synthetic_dir / "images")
    one = evaluate_checkpoint(str(out / "final"), cfg, output_dir=str(tmp_path / "one"))
    assert (after / "generations" / "synthetic.jsonl").read_text() == \
        (tmp_path / "one" / "generations" / "synthetic.jsonl").read_text()
    assert one["synthetic"].metrics == result["metrics"]
