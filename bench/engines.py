"""One training core, three layouts on CPU: 1 process vs 2 FSDP2 ranks vs 2 DDP ranks, side by side.

    python bench/engines.py                          # tiny LLaVA, 6 steps each
    python bench/engines.py --steps 10 --model llava_tiny

Each layout trains the same tiny model on the same synthetic data through the real loop
(:class:`mmtune.training.loop.SFTRecipe`) with the same global batch (one process
accumulates 2 micro-batches per step, the 2-rank runs take one each), each in fresh
processes (``torchrun`` with gloo for 2 ranks, one thread per rank). Reported per layout:

* step time: the median over the steps after the first of the loop's ``perf/step_time_s``;
* peak RSS per rank: the largest ``ru_maxrss`` of the ranks (the whole process: python,
  torch, the data), in MiB;
* parameter + optimizer bytes per rank: the bytes each rank holds of the parameters
  (its local shard under FSDP2) and of the AdamW states, the largest rank's, and its ratio
  to DDP's (the goal: FSDP2 <= 0.55x DDP);
* the last step's loss (the three must agree: the same global batch).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {  # name: (processes, engine, gradient accumulation)
    "1 process": (1, "ddp", 2),
    "2 ranks FSDP2": (2, "fsdp2", 1),
    "2 ranks DDP": (2, "ddp", 1),
}


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def worker(out: str, overrides: list[str]) -> None:
    """Train through the loop in this process (one rank); write this rank's measurements."""
    import torch

    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    torch.set_num_threads(1)
    recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
    recipe.setup()
    recipe.train()
    params = sum(_local_bytes(p) for p in recipe.model.parameters())
    optim = sum(_local_bytes(v) for state in recipe.optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    rank = recipe.accelerator.process_index
    recipe.cleanup()
    with open(out.format(rank=rank), "w") as f:
        json.dump({"rank": rank, "param_bytes": params, "optim_bytes": optim,
                   "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)


def run_layout(name: str, work: Path, data: Path, model: str, steps: int) -> dict:
    processes, engine, accum = LAYOUTS[name]
    run = work / name.replace(" ", "_")
    overrides = ["experiment=demo_single_image", f"model={model}", f"training.output_dir={run}",
                 f"synthetic.out_dir={data}", f"data.cache_dir={data}/cache", "synthetic.n_train=64",
                 "synthetic.n_test=4", "training.eval_before=false", "training.eval_after=false",
                 "training.save_final=false", "logging.progress_bar=false", "collator.batch_size=4",
                 f"training.max_steps={steps}", f"training.backend.engine={engine}",
                 f"training.gradient_accumulation_steps={accum}"]
    out = str(work / (run.name + "_rank{rank}.json"))
    script = [str(Path(__file__).resolve()), "--worker", out, *overrides]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
            str(_free_port()), *script] if processes > 1 else [sys.executable, *script])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    ranks = [json.loads(Path(out.format(rank=r)).read_text()) for r in range(processes)]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"step_s": statistics.median(m["perf/step_time_s"] for m in metrics[1:]),
            "rss_mib": max(r["peak_rss_mib"] for r in ranks),
            "state_bytes": max(r["param_bytes"] + r["optim_bytes"] for r in ranks),
            "param_bytes": max(r["param_bytes"] for r in ranks), "optim_bytes": max(r["optim_bytes"] for r in ranks),
            "loss": metrics[-1]["train/loss"]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llava_tiny", help="model config (configs/model/<name>.yaml)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per layout")
    args = parser.parse_args()
    from mmtune.data.synthetic import generate_synthetic

    with tempfile.TemporaryDirectory(prefix="mmtune-bench-engines-") as tmp:
        work = Path(tmp)
        data = work / "data"
        generate_synthetic(data, n_train=64, n_test=4, n_llava=0, seed=0, image_size=56,
                           min_images=1, max_images=1, max_turns=3)
        results = {name: run_layout(name, work, data, args.model, args.steps) for name in LAYOUTS}
    ddp = results["2 ranks DDP"]["state_bytes"]
    print(f"model={args.model}, {args.steps} steps, global batch 2 micro-batches of 4 samples, fp32, CPU gloo")
    print(f"| layout | step time (s) | peak RSS per rank (MiB) | params + AdamW per rank (KiB) | vs 2 DDP ranks "
          f"| last loss |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['step_s']:.3f} | {r['rss_mib']:.0f} | {r['state_bytes'] / 1024:.1f} "
              f"({r['param_bytes'] / 1024:.1f} + {r['optim_bytes'] / 1024:.1f}) | {r['state_bytes'] / ddp:.2f}x "
              f"| {r['loss']:.6f} |")
    ratio = results["2 ranks FSDP2"]["state_bytes"] / ddp
    print(f"FSDP2 / DDP parameter + optimizer bytes per rank: {ratio:.3f} (goal <= 0.55: "
          f"{'met' if ratio <= 0.55 else 'NOT met'})")


if __name__ == "__main__":
    main()
