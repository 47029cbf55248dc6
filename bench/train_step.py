"""Training-step cost on CPU: gradient checkpointing on/off, packing vs padding, same data.

    python bench/train_step.py                       # tiny + llava_100m (+ internlm_xc2_tiny if present)
    python bench/train_step.py --models llava_tiny --samples 64

For each model the same synthetic dialogues are trained through the real loop
(:class:`mmtune.training.loop.SFTRecipe`, one optimizer step per micro-batch) four
ways: {padding, packing} x {no checkpointing, gradient checkpointing}. Reported per
configuration (each in a fresh process): seconds per sample over the steps after the
first, tokens computed (incl. padding) per real token, and peak resident memory above
the process's size before training (sampled every 5 ms: on CPU, activations live in
ordinary process memory). Ratios are printed side by side.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]

# model config -> (samples, padding batch size, packing row length, image size, images per dialogue)
MODELS = {
    "llava_tiny": (64, 8, 1024, 56, 4),
    "llava_100m": (12, 2, 4096, 336, 2),
    "internlm_xc2_tiny": (32, 4, 2048, 64, 4),
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


def run_one(model: str, data_dir: Path, out_dir: Path, *, samples: int, batch_size: int, row_length: int,
            packing: bool, checkpointing: bool) -> dict:
    """One configuration in a fresh process, so peak memory is not hidden by memory freed earlier."""
    import json
    import subprocess

    spec = dict(model=model, data_dir=str(data_dir), out_dir=str(out_dir), samples=samples, batch_size=batch_size,
                row_length=row_length, packing=packing, checkpointing=checkpointing)
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure(model: str, data_dir: str, out_dir: str, *, samples: int, batch_size: int, row_length: int,
             packing: bool, checkpointing: bool) -> dict:
    import json

    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    overrides = [
        "experiment=demo", f"model={model}", f"training.output_dir={out_dir}", f"synthetic.out_dir={data_dir}",
        f"synthetic.n_train={samples}", f"data.cache_dir={data_dir}/cache",
        "training.eval_before=false", "training.eval_after=false", "training.save_final=false",
        "logging.progress_bar=false", "training.epochs=1", "training.warmup_ratio=0",
        f"training.gradient_checkpointing={str(checkpointing).lower()}",
        f"collator.max_length={row_length}",
        f"collator.batching={'packing' if packing else 'padding'}",
        f"collator.batch_size={1 if packing else batch_size}",
    ]
    recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
    recipe.setup()
    plan = recipe.data.plan(0)
    lengths = recipe.data.lengths.lengths
    real = sum(int(lengths[k[0] if isinstance(k, tuple) else k]) for batch in plan for k in batch)
    computed = 0  # the collator pads every row of a batch to the batch's longest row
    for batch in plan:
        rows: dict = {}
        for key in batch:
            index, row = key if packing else (key, key)
            rows[row] = rows.get(row, 0) + int(lengths[index])
        computed += len(rows) * max(rows.values())
    with PeakRSS() as mem:
        recipe.train()
    recipe.cleanup()
    # Step 1 pays one-off costs (allocator growth, kernel selection): time the rest.
    steps = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = sum(m["perf/step_time_s"] for m in steps[1:])
    timed_samples = sum(len(batch) for batch in plan[1:len(steps)])
    return {"steps": len(plan), "samples": sum(len(b) for b in plan), "s_per_sample": timed / timed_samples,
            "computed_per_real": computed / real, "peak_mib": mem.delta_mib, "params": recipe.num_params}


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--samples", type=int, default=None, help="override the samples per model")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one configuration (JSON spec)
    args = parser.parse_args(argv)
    if args.one:
        import json

        spec = json.loads(args.one)
        print(json.dumps(_measure(spec.pop("model"), spec.pop("data_dir"), spec.pop("out_dir"), **spec)))
        return 0

    from mmtune.data.synthetic import generate_synthetic

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            if not (REPO / "configs" / "model" / f"{model}.yaml").is_file():
                print(f"\n{model}: configs/model/{model}.yaml not found, skipped")
                continue
            samples, batch, row, image_size, max_images = MODELS.get(model, (16, 4, 2048, 64, 4))
            samples = args.samples or samples
            data = Path(tmp) / f"data-{model}"
            generate_synthetic(data, n_train=samples, n_test=1, n_llava=0, seed=0, image_size=image_size,
                               min_images=1, max_images=max_images, max_turns=3)
            results = {}
            try:
                for packing in (False, True):
                    for ckpt in (False, True):
                        key = ("packing" if packing else "padding", "ckpt" if ckpt else "no-ckpt")
                        results[key] = run_one(model, data, Path(tmp) / f"run-{model}-{'-'.join(key)}",
                                               samples=samples, batch_size=batch, row_length=row, packing=packing,
                                               checkpointing=ckpt)
            except Exception as err:  # report and go on with the next model
                print(f"\n{model}: failed: {type(err).__name__}: {err}")
                continue
            params = results[("padding", "no-ckpt")]["params"]
            print(f"\n{model}: {params / 1e6:.1f}M parameters, {samples} dialogues; padding batch {batch}, "
                  f"packing rows of {row} tokens")
            print(f"  {'batching':<9} {'grad ckpt':<9} {'steps':>5} {'s/sample':>9} {'computed/real':>13} "
                  f"{'peak MiB':>9}")
            for (mode, ck), r in results.items():
                print(f"  {mode:<9} {ck:<9} {r['steps']:>5} {r['s_per_sample']:>9.4f} "
                      f"{r['computed_per_real']:>13.3f} {r['peak_mib']:>9.1f}")
            for mode in ("padding", "packing"):
                a, b = results[(mode, "ckpt")], results[(mode, "no-ckpt")]
                print(f"  {mode}: checkpointing / none = time x{a['s_per_sample'] / b['s_per_sample']:.2f}, "
                      f"peak memory x{a['peak_mib'] / max(b['peak_mib'], 1e-9):.2f}")
            for ck in ("no-ckpt", "ckpt"):
                a, b = results[("packing", ck)], results[("padding", ck)]
                print(f"  {ck}: packing / padding = time per sample x{a['s_per_sample'] / b['s_per_sample']:.2f}, "
                      f"peak memory x{a['peak_mib'] / max(b['peak_mib'], 1e-9):.2f}, "
                      f"computed tokens x{a['computed_per_real'] / b['computed_per_real']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
