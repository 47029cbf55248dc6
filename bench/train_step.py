"""Training-step cost on CPU: gradient checkpointing on/off, packing vs padding, same data.

    python bench/train_step.py                       # tiny + llava_100m (+ internlm_xc2_tiny if present)
    python bench/train_step.py --models llava_tiny --samples 64

For each model the same synthetic dialogues are trained through the real loop
(:class:`mmtune.training.loop.SFTRecipe`, one optimizer step per micro-batch) four
ways: {padding, packing} x {no checkpointing, gradient checkpointing}. Reported per
configuration: seconds per sample, tokens computed (incl. padding) per real token,
and peak resident memory above the pre-training baseline (sampled every 5 ms: on CPU
activations live in ordinary process memory). Ratios are printed side by side.
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

# model config -> (samples, padding batch size, packing row length, image size)
MODELS = {
    "llava_tiny": (64, 8, 1024, 56),
    "llava_100m": (6, 2, 4096, 336),
    "internlm_xc2_tiny": (16, 4, 2048, None),
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
    import gc

    from accelerate.state import AcceleratorState, GradientState

    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    overrides = [
        "experiment=demo", f"model={model}", f"training.output_dir={out_dir}", f"synthetic.out_dir={data_dir}",
        f"synthetic.n_train={samples}", f"data.cache_dir={data_dir}/cache",
        "training.eval_before=false", "training.eval_after=false", "training.save_final=false",
        "logging.progress_bar=false", "logging.metrics_file=false", "training.epochs=1", "training.warmup_ratio=0",
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
    computed = 0
    for batch in plan:
        if packing:
            computed += row_length * len({k[1] for k in batch})
        else:
            computed += len(batch) * max(int(lengths[k]) for k in batch)
    n_samples = sum(len(batch) for batch in plan)
    gc.collect()
    with PeakRSS() as mem:
        started = time.perf_counter()
        recipe.train()
        seconds = time.perf_counter() - started
    recipe.cleanup()
    params = recipe.num_params
    del recipe
    gc.collect()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return {"steps": len(plan), "samples": n_samples, "s_per_sample": seconds / n_samples,
            "computed_per_real": computed / real, "peak_mib": mem.delta_mib, "params": params}


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--samples", type=int, default=None, help="override the samples per model")
    args = parser.parse_args(argv)

    from mmtune.data.synthetic import generate_synthetic

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            if not (REPO / "configs" / "model" / f"{model}.yaml").is_file():
                print(f"\n{model}: configs/model/{model}.yaml not found, skipped")
                continue
            samples, batch, row, image_size = MODELS.get(model, (16, 4, 2048, None))
            samples = args.samples or samples
            data = Path(tmp) / f"data-{model}"
            generate_synthetic(data, n_train=samples, n_test=1, n_llava=0, seed=0, image_size=image_size or 64)
            results = {}
            for packing in (False, True):
                for ckpt in (False, True):
                    key = ("packing" if packing else "padding", "ckpt" if ckpt else "no-ckpt")
                    results[key] = run_one(model, data, Path(tmp) / f"run-{model}-{'-'.join(key)}", samples=samples,
                                           batch_size=batch, row_length=row, packing=packing, checkpointing=ckpt)
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
