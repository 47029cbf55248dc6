"""SFT throughput and peak memory of a 7B-shaped model with its real vocabulary, per loss path and attention.

    python bench/gpu_sft.py                                     # LLaVA-1.5-7B shape (vocab 32,064), 8k packed rows
    python bench/gpu_sft.py --family internlm_xcomposer2        # XComposer2-VL-7B shape (vocab 92,544)
    python bench/gpu_sft.py --losses materialized,chunked --attention sdpa,flash_attention_2 --steps 5
    python bench/gpu_sft.py --dry                               # the same code paths, tiny, on CPU (seconds)

One :class:`~mmtune.training.loop.SFTRecipe` is built (the loop ``recipes/sft.py`` runs:
synthetic MMDU-style dialogues packed into rows of ``--max-length`` tokens, bf16
autocast, gradient checkpointing, AdamW, random weights, no download), then every
setting (loss path x attention implementation) runs ``--warmup`` steps and
``--steps`` measured steps of that loop in turn, on the same weights and the next
micro-batches of the same data. Between settings only ``training.loss_impl`` (a new
:class:`~mmtune.training.loss.TrainingLoss`) and the attention implementation
(transformers' ``set_attn_implementation``) change, so the model is built once.

Per setting: real tokens/s, step time and MFU (means over the measured steps, from the
loop's ``metrics.jsonl``) and the peak allocated GPU memory of the measured steps,
optimizer states included (they exist from the first warm-up step). A setting that
cannot run here (Liger or flash-attn not installed, no CUDA) gets a row saying why; one
that fails (out of memory) gets a row with the error, and the next setting still runs.
``--rows FILE`` appends the rows as a markdown table body (``bench/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import seven_b  # noqa: E402  (bench/ is not a package)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def recipe_overrides(args, work: Path) -> list[str]:
    """The demo experiment turned into the bench's run: 7B shape (or tiny), packed rows, bf16."""
    shape = seven_b.SHAPES[args.family]
    if args.dry:  # the shipped tiny model with the real vocabulary
        shape = {"text_config": {"vocab_size": shape["text_config"]["vocab_size"]}}
    vision = shape.get("vision_config", {})
    image_tokens = (vision.get("image_size", 56) // vision.get("patch_size", 14)) ** 2
    # the demo's dialogues: two images and ~150 text tokens; enough of them for every step of every setting
    per_row = max(1, args.max_length // (2 * image_tokens + 150))
    rows = (args.warmup + args.steps) * len(settings(args))
    context = ["context=8k"] if args.max_length > 4096 and args.family == "llava" else ["context=none"]
    return [
        "experiment=demo", *seven_b.overrides(args.family, shape), *context,
        "peft=none" if args.peft == "full" else f"peft={args.peft}",
        f"synthetic.out_dir={work}/data", f"synthetic.n_train={math.ceil(1.5 * rows * per_row) + 16}",
        "synthetic.n_test=1", f"synthetic.image_size={vision.get('image_size', 56)}",
        f"model.torch_dtype={'float32' if args.dry else 'bfloat16'}", "model.attn_implementation=sdpa",
        "collator.batching=packing", "collator.batch_size=1", f"collator.max_length={args.max_length}",
        "collator.max_images_per_batch=null",
        f"training.mixed_precision={'no' if args.dry else 'bf16'}", "training.gradient_checkpointing=true",
        "training.vision.train=false", "training.lr=1e-5", f"training.max_steps={rows}", "training.warmup_ratio=0",
        "training.eval_before=false", "training.eval_after=false", "training.save_final=false",
        f"training.output_dir={work}/run", f"data.cache_dir={work}/cache",
        "logging.progress_bar=false", "logging.every_steps=1",
    ]


def settings(args) -> list[tuple[str, str]]:
    """(loss path, attention) pairs: every loss path with the first attention, then the
    resolved ``auto`` path with each other attention implementation."""
    losses = args.losses.split(",")
    attentions = args.attention.split(",")
    pairs = [(loss, attentions[0]) for loss in losses]
    return pairs + [("auto", attention) for attention in attentions[1:]]


def unavailable(loss: str, attention: str, device_type: str) -> str:
    """Why a setting cannot run here ("" when it can)."""
    from transformers.utils import is_flash_attn_2_available

    from mmtune.training.loss import choose_loss_impl

    try:
        choose_loss_impl(loss, device_type=device_type)
    except ValueError as err:
        return str(err)
    if attention == "flash_attention_2" and not (device_type == "cuda" and is_flash_attn_2_available()):
        return "flash-attn is not installed (or no CUDA)"
    return ""


def run_steps(recipe, n: int) -> None:
    """``n`` more optimizer steps of the recipe's own loop."""
    recipe.total_steps = recipe.step + n
    recipe.train()


def measure(recipe, loss: str, attention: str, args) -> dict:
    import torch

    from mmtune.training.loss import TrainingLoss

    acc = recipe.accelerator
    acc.unwrap_model(recipe.model).set_attn_implementation(attention)  # a no-op when it is the current one
    recipe.loss = TrainingLoss(recipe.adapter, recipe.model, impl=loss, chunk_size=recipe.cfg.training.loss_chunk_size,
                               device=acc.device)
    run_steps(recipe, args.warmup)
    first = recipe.step
    if acc.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    run_steps(recipe, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if acc.device.type == "cuda" else None
    lines = (recipe.output_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if r["step"] > first]
    mfu = [r["perf/mfu"] for r in rows if r.get("perf/mfu") is not None]
    return {"tokens_per_s": statistics.mean(r["perf/tokens_per_s"] for r in rows),
            "step_s": statistics.mean(r["perf/step_time_s"] for r in rows), "peak_gib": peak,
            "mfu": statistics.mean(mfu) if mfu else None, "loss": rows[-1]["train/loss"],
            "description": recipe.loss.description, "steps": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(seven_b.SHAPES), default="llava")
    parser.add_argument("--losses", default="materialized,chunked,fused",
                        help="training.loss_impl values, each with the first --attention")
    parser.add_argument("--attention", default="sdpa,flash_attention_2",
                        help="attention implementations; the ones after the first run with the `auto` loss")
    parser.add_argument("--max-length", type=int, default=8192, help="tokens per packed row")
    parser.add_argument("--steps", type=int, default=4, help="measured optimizer steps per setting")
    parser.add_argument("--warmup", type=int, default=1, help="steps per setting before measuring")
    parser.add_argument("--peft", default="full", help="full, or a peft config name (lora)")
    parser.add_argument("--dry", action="store_true", help="the tiny model on CPU, real vocabulary, 1k rows")
    parser.add_argument("--rows", help="append markdown table rows to this file")
    parser.add_argument("--work", help="data and run directory (default: a new temporary one)")
    args = parser.parse_args()
    if args.dry and args.max_length == 8192:
        args.max_length = 1024

    import torch

    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    seven_b.register_full_vocab_adapters()
    work = Path(args.work or tempfile.mkdtemp(prefix="mmtune_gpu_sft_"))
    started = time.perf_counter()
    recipe = SFTRecipe(to_sft_config(compose_sft_config(recipe_overrides(args, work))))
    recipe.setup()
    device_type = recipe.accelerator.device.type
    model = recipe.accelerator.unwrap_model(recipe.model)
    print(seven_b.describe(model, recipe.adapter))
    print(f"run: {args.peft} fine-tune, rows of {args.max_length} packed tokens, {recipe.cfg.training.mixed_precision} "
          f"autocast, gradient checkpointing; set up in {time.perf_counter() - started:.0f} s", flush=True)
    part = f"SFT {args.family} {args.max_length // 1024}k packed"
    for loss, attention in settings(args):
        setting = f"loss={loss} attn={attention}"
        reason = unavailable(loss, attention, device_type)
        if reason:
            result = {"note": f"skipped: {reason}"}
        else:
            try:
                result = measure(recipe, loss, attention, args)
                result["note"] = result.pop("description")
            except Exception as err:  # noqa: BLE001 - one failed setting (OOM) must not end the bench
                result = {"note": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"}
                recipe.optimizer.zero_grad(set_to_none=True)
                if device_type == "cuda":
                    torch.cuda.empty_cache()
        tps = f"{result['tokens_per_s']:,.0f}" if "tokens_per_s" in result else "-"
        peak = f"{result['peak_gib']:.1f}" if result.get("peak_gib") is not None else "-"
        extra = ""
        if "step_s" in result:
            extra = (f"step {result['step_s']:.2f} s, loss {result['loss']:.3f}"
                     + (f", MFU {100 * result['mfu']:.1f}%" if result.get("mfu") is not None else "") + "; ")
        print(f"RESULT {part} | {setting:<36} | tokens/s {tps:>9} | peak GiB {peak:>6} | {extra}{result['note']}",
              flush=True)
        if args.rows:
            with open(args.rows, "a") as rows:
                rows.write(f"| {part} | {setting} | {tps} | {peak} | {extra}{result['note']} |\n")
    recipe.cleanup()


if __name__ == "__main__":
    main()
