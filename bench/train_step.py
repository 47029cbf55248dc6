"""Training-step cost on CPU: packing (block mask, per-sample attention) vs padding, same optimizer work.

    python bench/train_step.py                       # llava_tiny + llava_100m (+ internlm_xc2_tiny)
    python bench/train_step.py --models llava_tiny --samples 64 --repeats 3 --checkpointing off

For each model the same synthetic dialogues are trained through the real loop
(:class:`mmtune.training.loop.SFTRecipe`) three ways, each in a fresh process:

* ``padding``: every sample its own row, padded to the micro-batch's longest;
* ``packing, block mask``: packed rows with transformers' block-diagonal ``[B, 1, L, L]``
  mask (``training.packed_attention=off``, what packing ran before per-sample attention);
* ``packing, per sample``: packed rows, each sample attending alone
  (``training.packed_attention=auto``).

All three run *the same micro-batches*: the packing plan (first-fit-decreasing rows of
``collator.max_length``, one row per micro-batch, one micro-batch per optimizer step);
``padding`` collates each of those micro-batches unpacked. So every configuration takes
the same optimizer steps over the same samples per step, and its per-step losses must
agree (printed side by side). Weights are fp32 by default (``--dtype``), so the losses
agree up to fp32 rounding; with bf16 weights they drift apart by bf16 rounding after a
few updates. Each configuration runs with and without gradient checkpointing, one
thread per run (``--threads``).

Reported per configuration: milliseconds per real (non-padding) token by the wall clock
and by the process's CPU time (which moves far less with other load on the machine),
the median over the steps after the first (step 1 pays one-off costs) of step time /
real tokens in the step, the step including the optimizer step; the median over
``--repeats`` runs of that; attention scores computed per layer relative to the samples' own (``Σ l²`` over
samples; padding and the block mask compute more, per-sample only adds the row
padding's own); tokens computed per real token; peak resident memory above the process's
size before training (sampled every 5 ms: on CPU activations live in process memory);
the mean loss. Ratios against padding are the median over steps of the per-step ratio.
Runs of one model take turns (padding, block, per-sample, padding, ...), so a change in
machine load hits all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]

# model config -> (samples, packing row length, image size, images per dialogue)
MODELS = {
    "llava_tiny": (64, 1024, 56, 4),
    "llava_100m": (24, 4096, 336, 2),
    "internlm_xc2_tiny": (32, 2048, 64, 4),
}
# name -> (collate packed rows, training.packed_attention)
CONFIGS = {
    "padding": (False, "off"),
    "packing, block mask": (True, "off"),
    "packing, per sample": (True, "auto"),
}


class PeakRSS:
    """Peak resident set size while the block runs, sampled in a thread."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self.process = psutil.Process()
        self.interval = interval
        self.peak = 0

    def __enter__(self):
        self.baseline = self.process.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def delta_mib(self) -> float:
        return (self.peak - self.baseline) / 2**20


def run_one(spec: dict, threads: int) -> dict:
    """One configuration in a fresh process, so peak memory is not hidden by memory freed earlier."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _work(plan: list, lengths, *, packed: bool, per_sample: bool) -> tuple[int, int, int]:
    """(tokens computed, attention scores per layer computed, the samples' own ``Σ l²``) over ``plan``.

    Rows are padded to the micro-batch's longest row; unpacked, every sample is a row.
    Padding masks and the block mask score every row in full (``rows x longest²``);
    per-sample attention scores each sample and the row padding on their own.
    """
    tokens = scores = own = 0
    for batch in plan:
        rows: dict = {}
        for k, (index, row) in enumerate(batch):
            rows.setdefault(row if packed else k, []).append(int(lengths[index]))
        longest = max(sum(r) for r in rows.values())
        tokens += len(rows) * longest
        own += sum(n * n for r in rows.values() for n in r)
        if per_sample:
            scores += sum(n * n for r in rows.values() for n in r) + sum((longest - sum(r)) ** 2 for r in rows.values())
        else:
            scores += len(rows) * longest * longest
    return tokens, scores, own


def _measure(model: str, data_dir: str, out_dir: str, *, samples: int, row_length: int, packed: bool,
             packed_attention: str, checkpointing: bool, dtype: str) -> dict:
    from mmtune.data.collator import MultiImageCollator
    from mmtune.data.datamodule import CollateWithMeta
    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    overrides = [
        "experiment=demo", f"model={model}", f"training.output_dir={out_dir}", f"synthetic.out_dir={data_dir}",
        f"synthetic.n_train={samples}", f"data.cache_dir={data_dir}/cache",
        "training.eval_before=false", "training.eval_after=false", "training.save_final=false",
        "logging.progress_bar=false", "training.epochs=1", "training.warmup_ratio=0",
        f"training.gradient_checkpointing={str(checkpointing).lower()}",
        f"collator.max_length={row_length}", "collator.batching=packing", "collator.batch_size=1",
        f"training.packed_attention={packed_attention}", f"model.torch_dtype={dtype}",
    ]
    recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
    recipe.setup()
    if not packed:  # the packing plan's micro-batches, each sample its own padded row
        collator = recipe.data.dataset.collator()
        recipe.data.collate = CollateWithMeta(MultiImageCollator(
            collator.pad_token_id, packed=False, pad_to_multiple_of=collator.pad_to_multiple_of,
            image_pipeline=collator.image_pipeline))
    plan = recipe.data.plan(0)
    lengths = recipe.data.lengths.lengths
    real = sum(int(lengths[i]) for batch in plan for i, _ in batch)
    computed, scores, own = _work(plan, lengths, packed=packed, per_sample=recipe.attention.per_sample)
    # The loop logs every step: the process's CPU time at each log call splits it into steps
    # (CPU time moves far less than wall time with other work on the machine).
    cpu_marks = [time.process_time()]
    log = recipe.logger.log

    def log_and_mark(step, metrics):
        cpu_marks.append(time.process_time())
        return log(step, metrics)

    recipe.logger.log = log_and_mark
    with PeakRSS() as mem:
        recipe.train()
    recipe.cleanup()
    steps = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    tokens = [m["perf/tokens_per_s"] * m["perf/step_time_s"] for m in steps]  # real tokens of each step
    return {"steps": len(steps), "samples": sum(len(b) for b in plan), "real_tokens": real,
            "wall_per_token": [m["perf/step_time_s"] / n for m, n in zip(steps, tokens)],
            "cpu_per_token": [(b - a) / n for a, b, n in zip(cpu_marks, cpu_marks[1:], tokens)],
            "losses": [m["train/loss"] for m in steps],
            "computed_per_real": computed / real, "scores_per_own": scores / own, "peak_mib": mem.delta_mib,
            "params": recipe.num_params, "attention": recipe.attention.description}


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--samples", type=int, default=None, help="override the samples per model")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every configuration (medians reported)")
    parser.add_argument("--checkpointing", choices=("both", "off", "on"), default="both")
    parser.add_argument("--dtype", default="float32",
                        help="model weights (float32: the configurations' losses agree to float rounding; "
                             "bfloat16 weights drift apart by bf16 rounding after a few updates)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (1: on a shared machine, waits at multi-thread barriers "
                             "swamp the small kernels of the tiny models)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one configuration (JSON spec)
    args = parser.parse_args(argv)
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(_measure(spec.pop("model"), spec.pop("data_dir"), spec.pop("out_dir"), **spec)))
        return 0

    from mmtune.data.synthetic import generate_synthetic

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s) per run, {args.dtype} weights, CPU, load average "
          f"{os.getloadavg()[0]:.1f} at start")
    ckpts = {"both": (False, True), "off": (False,), "on": (True,)}[args.checkpointing]
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            if not (REPO / "configs" / "model" / f"{model}.yaml").is_file():
                print(f"\n{model}: configs/model/{model}.yaml not found, skipped")
                continue
            samples, row, image_size, max_images = MODELS.get(model, (16, 2048, 64, 4))
            samples = args.samples or samples
            data = Path(tmp) / f"data-{model}"
            generate_synthetic(data, n_train=samples, n_test=1, n_llava=0, seed=0, image_size=image_size,
                               min_images=1, max_images=max_images, max_turns=3)
            runs: dict = {}
            try:
                for repeat in range(args.repeats):
                    for ckpt in ckpts:
                        for name, (packed, mode) in CONFIGS.items():
                            key = (name, ckpt)
                            out = Path(tmp) / f"run-{model}-{repeat}-{'ckpt' if ckpt else 'no-ckpt'}-{mode}-{packed}"
                            spec = dict(model=model, data_dir=str(data), out_dir=str(out), samples=samples,
                                        row_length=row, packed=packed, packed_attention=mode, checkpointing=ckpt,
                                        dtype=args.dtype)
                            runs.setdefault(key, []).append(run_one(spec, args.threads))
            except Exception as err:  # report and go on with the next model
                print(f"\n{model}: failed: {type(err).__name__}: {err}")
                continue
            _report(model, samples, row, runs, ckpts)
    return 0


def _median_ms(rs: list, clock: str) -> float:
    """Median over runs of the median over steps 2.. of ms per real token."""
    return statistics.median(statistics.median(r[clock][1:] or r[clock]) * 1e3 for r in rs)


def _report(model: str, samples: int, row: int, runs: dict, ckpts: tuple) -> None:
    first = runs[("padding", ckpts[0])][0]
    print(f"\n{model}: {first['params'] / 1e6:.1f}M parameters, {samples} dialogues, {first['real_tokens']} real "
          f"tokens; {first['steps']} optimizer steps of one packing row ({row} tokens) each, the same samples per "
          f"step in every configuration; {len(runs[('padding', ckpts[0])])} run(s) each")
    print(f"  {'configuration':<21} {'ckpt':<4} {'wall ms/tok':>11} {'cpu ms/tok':>10} {'attn scores':>11} "
          f"{'computed/real':>13} {'peak MiB':>9} {'mean loss':>10}")
    for ckpt in ckpts:
        for name in CONFIGS:
            rs = runs[(name, ckpt)]
            print(f"  {name:<21} {'on' if ckpt else 'off':<4} {_median_ms(rs, 'wall_per_token'):>11.4f} "
                  f"{_median_ms(rs, 'cpu_per_token'):>10.4f} {rs[0]['scores_per_own']:>10.2f}x "
                  f"{rs[0]['computed_per_real']:>13.3f} {statistics.median(x['peak_mib'] for x in rs):>9.1f} "
                  f"{statistics.mean(rs[0]['losses']):>10.6f}")
    for ckpt in ckpts:
        tag = f"ckpt {'on ' if ckpt else 'off'}"
        base = runs[("padding", ckpt)]
        for name in list(CONFIGS)[1:]:
            other = runs[(name, ckpt)]
            ratio = {clock: statistics.median(b / a for ra, rb in zip(base, other)
                                              for a, b in zip(ra[clock][1:], rb[clock][1:]))
                     for clock in ("wall_per_token", "cpu_per_token")}
            memory = statistics.median(x["peak_mib"] for x in other) / max(
                statistics.median(x["peak_mib"] for x in base), 1e-9)
            diff = max(abs(a - b) for ra, rb in zip(base, other) for a, b in zip(ra["losses"], rb["losses"]))
            print(f"  {tag}: {name} / padding = time per real token x{ratio['wall_per_token']:.2f} wall, "
                  f"x{ratio['cpu_per_token']:.2f} cpu (medians of per-step ratios); peak memory x{memory:.2f}; "
                  f"per-step losses differ by at most {diff:.1e}")
        for name in CONFIGS:
            losses = "  ".join(f"{x:.6f}" for x in runs[(name, ckpt)][0]["losses"][:5])
            print(f"  {tag}: losses of steps 1-5, {name + ':':<20} {losses}")


if __name__ == "__main__":
    sys.exit(main())
