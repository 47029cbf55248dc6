"""Sequence parallelism on CPU: one process vs 2 ranks (gloo) on the same long rows.

    OMP_NUM_THREADS=1 python bench/sequence_parallel.py --lengths 8192 16384

For each row length it runs one forward + backward of the tiny LLaVA model (2 layers,
width 64, sdpa, chunked loss) on one text row of random tokens: once whole in one
process, once as 2 shards under :class:`~mmtune.training.sequence_parallel.SequenceParallel`
(``torchrun --nproc_per_node 2``). It prints, side by side:

- activation memory per rank: the bytes autograd saves for the backward pass (every tensor
  handed to ``saved_tensors_hooks``, counted once per storage), what grows with the row;
- step time (forward + backward, the median of ``--repeat``);
- the loss difference: the group's summed loss against the one-process loss, per loss token.

A tiny model's weights are a few hundred kB, so activation memory is nearly all of a rank's
working set; the ratio is what sequence parallelism buys, independent of the model width.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _worker(out: str, lengths: list[int], repeat: int) -> None:
    import torch
    import torch.distributed as dist

    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter
    from mmtune.training.loss import TrainingLoss
    from mmtune.training.sequence_parallel import SequenceParallel

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    adapter = build_adapter(ModelConfig(family="llava"))
    model = adapter.load_model(seed=0, attn_implementation="sdpa").train()
    loss = TrainingLoss(adapter, model, impl="chunked", chunk_size=1024)
    sp = SequenceParallel.create(dist.get_world_size(), adapter, model, attn_implementation="sdpa") \
        if distributed else None
    results = {}
    for length in lengths:
        generator = torch.Generator().manual_seed(length)
        ids = torch.randint(10, model.config.text_config.vocab_size, (1, length), generator=generator)
        inputs = {"input_ids": ids, "attention_mask": None, "position_ids": torch.arange(length)[None],
                  "pixel_values": None}
        labels = ids.clone()
        times, saved = [], 0
        for _ in range(repeat):
            seen: dict[int, int] = {}

            def pack(t):
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
                return t

            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                if sp is None:
                    summed = loss(model, inputs, labels)
                else:
                    with sp.step(model, inputs, labels) as targets:
                        summed = loss(model, inputs, targets, shifted=True)
            summed.backward()
            times.append(time.perf_counter() - started)
            saved = sum(seen.values())
        total = summed.detach().clone()
        if sp is not None:
            dist.all_reduce(total)
        results[length] = {"saved_bytes": saved, "step_s": statistics.median(times), "loss_sum": float(total),
                           "loss_tokens": int((labels[:, 1:] != -100).sum())}
    rank = dist.get_rank() if distributed else 0
    Path(out.format(rank=rank)).write_text(json.dumps(results))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.lengths, args.repeat)
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory() as tmp:
        one, two = f"{tmp}/one_{{rank}}.json", f"{tmp}/two_{{rank}}.json"
        common = [__file__, "--lengths", *map(str, args.lengths), "--repeat", str(args.repeat)]
        subprocess.run([sys.executable, *common, "--worker", one], env=env, check=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *common,
                        "--worker", two], env=env, check=True)
        alone = json.loads(Path(one.format(rank=0)).read_text())
        ranks = [json.loads(Path(two.format(rank=r)).read_text()) for r in range(2)]
    print("| row tokens | activation MiB, 1 process | per rank, SP=2 | ratio | step s, 1 process | SP=2 | "
          "loss diff per token |")
    print("|---|---|---|---|---|---|---|")
    for length in map(str, args.lengths):
        a = alone[length]
        per_rank = max(r[length]["saved_bytes"] for r in ranks)
        step = max(r[length]["step_s"] for r in ranks)
        diff = abs(ranks[0][length]["loss_sum"] - a["loss_sum"]) / a["loss_tokens"]
        print(f"| {length} | {a['saved_bytes'] / 2**20:.1f} | {per_rank / 2**20:.1f} | "
              f"{per_rank / a['saved_bytes']:.2f}x | {a['step_s']:.2f} | {step:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
