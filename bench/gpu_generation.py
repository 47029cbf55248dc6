"""Decode throughput of the batched KV generator on a LLaVA-1.5-7B-shaped random model (GPU).

    python bench/gpu_generation.py                      # B = 1, 8, 32 at a 1024-token context
    python bench/gpu_generation.py --batch-sizes 1,8,32 --context 2048 --steps 64
    python bench/gpu_generation.py --tiny --device cpu  # smoke run of the script itself
    python bench/gpu_generation.py --dialogues 0 --rows rows.md   # decode only; markdown rows for gpu_check.sh

Two measurements, printed side by side:

1. Decode tokens/s at each batch size: ``B`` rows, each holding ``--context`` cached
   tokens in a :class:`~mmtune.evaluation.generation.batched_kv.BatchedKVCache` (rows of different
   lengths, so the mask has holes as in real use), then ``--steps`` timed one-token steps.
   Next to it, the roofline estimate of :mod:`mmtune.evaluation.generation.throughput` for this GPU
   (weights + KV read once per step at ``DECODE_EFFICIENCY`` of the HBM bandwidth);
   measured / estimated calibrates that efficiency.
2. End to end (``--dialogues``, 0 skips it): MMDU-shaped dialogues (336 px images, 576
   tokens each) answered by :class:`~mmtune.evaluation.generation.generator.DialogueGenerator` at
   batch 1 and at the largest batch size: wall time, forward calls, tokens, and how many
   answers equal batch 1's (bf16: padding changes rounding, so a few greedy answers may
   diverge; the fp32 equality is what the test suite checks).

The model: LLaVA-1.5-7B's shape with its 32,064-entry vocabulary (``bench/seven_b.py``:
Vicuna-7B text model, 4096 wide, 32 layers, 32 heads, and a CLIP ViT-L/14-336 tower),
random weights, bf16, SDPA; ``--tiny`` is the test-sized model with the same vocabulary.
The first line printed gives the shapes. Needs a CUDA GPU with >= 40 GB.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seven_b  # noqa: E402  (bench/ is not a package)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_rate(gen, batch: int, context: int, steps: int) -> float:
    """Tokens/s of ``steps`` one-token decode steps of ``batch`` rows with ~``context`` cached tokens each."""
    import torch

    from mmtune.evaluation.generation.batched_kv import BatchedKVCache

    g = torch.Generator().manual_seed(batch)
    vocab = min(len(gen.adapter.tokenizer), 500)
    with torch.inference_mode():
        kv = BatchedKVCache(gen._new_cache, batch, gen.device)
        # rows 10% apart in length: the padding and holes of real batched use
        rows = [torch.randint(10, vocab, (max(1, context - (context // 10) * (b % 2)),), generator=g).tolist() for b in range(batch)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [gen.pad_id] * (width - len(r)) for r in rows], device=gen.device)
        positions, last = kv.extend(rows, width)
        logits = gen._forward(ids, None, kv.mask, positions, kv.cache, keep=last)
        token = logits.argmax(-1)
        timed = 0.0
        for step in range(steps + 3):  # 3 warm-up steps
            if step == 3:
                _sync(gen.device)
                start = time.perf_counter()
            positions, _ = kv.extend([[int(t)] for t in token.tolist()], 1)
            logits = gen._forward(token.unsqueeze(1), None, kv.mask, positions, kv.cache)
            token = logits.argmax(-1)
        _sync(gen.device)
        timed = time.perf_counter() - start
    return batch * steps / timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per row while decoding")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    parser.add_argument("--dialogues", type=int, default=16, help="end-to-end dialogues (0 = skip)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny test model instead of the 7B shape (smoke run)")
    parser.add_argument("--rows", help="append the decode rows as markdown table rows to this file")
    args = parser.parse_args()

    import torch
    from PIL import Image as PILImage

    from mmtune.data.dialogue import Dialogue, Image, Turn
    from mmtune.evaluation.config import GenerationConfig
    from mmtune.evaluation.generation.generator import DialogueGenerator
    from mmtune.evaluation.generation.throughput import DECODE_EFFICIENCY
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter
    from mmtune.training.plan import GPU_TYPES

    device = torch.device(args.device)
    dtype = "float32" if args.tiny else "bfloat16"
    seven_b.register_full_vocab_adapters()
    shape = {"text_config": {"vocab_size": seven_b.LLAVA_7B["text_config"]["vocab_size"]}} if args.tiny else seven_b.LLAVA_7B
    adapter = build_adapter(ModelConfig(family="llava_full_vocab", architecture=shape, torch_dtype=dtype))
    model = adapter.load_model(seed=0).to(device)
    print(seven_b.describe(model, adapter))
    params = sum(p.numel() for p in model.parameters())
    wbytes = params * next(model.parameters()).element_size()
    text = model.config.text_config
    kv_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * next(model.parameters()).element_size()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu = next((g for key, g in GPU_TYPES.items() if key.split("-")[0].upper() in name.upper()), None)
    print(f"{name}: random LLaVA {params / 1e9:.2f}B params, {dtype}, weights {wbytes / 1e9:.1f} GB, "
          f"KV {kv_per_token / 2**20:.2f} MiB/token" + (f"; roofline with {gpu.name} {gpu.hbm_tbps} TB/s" if gpu else ""))

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    gen = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=args.max_new_tokens, batch_size=1))
    print()
    print(f"{'B':>4} {'context':>8} {'decode tok/s':>13} {'per row':>9} {'vs B=1':>7} {'roofline tok/s':>15} {'measured/roofline':>18}")
    base = None
    for batch in sizes:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rate = decode_rate(gen, batch, args.context, args.steps)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        base = base or rate
        roof = ""
        if gpu:
            step = (wbytes + batch * kv_per_token * args.context) / (gpu.hbm_tbps * 1e12 * DECODE_EFFICIENCY)
            roof = f"{batch / step:>15,.0f} {rate / (batch / step):>18.2f}"
        print(f"{batch:>4} {args.context:>8} {rate:>13,.0f} {rate / batch:>9,.1f} {rate / base:>6.2f}x {roof}", flush=True)
        if args.rows:
            with open(args.rows, "a") as rows:
                rows.write(f"| decode, {args.context} cached tokens per row | B={batch} | {rate:,.0f} | "
                           f"{'-' if peak is None else f'{peak:.1f}'} | {rate / batch:,.1f} tok/s per row, "
                           f"{rate / base:.2f}x B=1; {args.steps} steps |\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if not args.dialogues:
        return
    root = tempfile.mkdtemp()
    size = model.config.vision_config.image_size
    dialogues = []
    for d in range(args.dialogues):
        turns = []
        for t in range(args.turns):
            path = os.path.join(root, f"{d}-{t}.png")
            PILImage.new("RGB", (size, size), ("red", "green", "blue", "white")[(d + t) % 4]).save(path)
            turns += [Turn("user", (f"Image{t + 1}: ", Image(path), f"\nDescribe Image{t + 1} in detail.")), Turn("assistant", ("ref",))]
        dialogues.append(Dialogue(f"g{d}", "bench", tuple(turns)))
    print()
    print(f"end to end: {args.dialogues} dialogues x {args.turns} turns, one {size} px image per turn, "
          f"max_new_tokens={args.max_new_tokens}")
    print(f"{'B':>4} {'wall s':>8} {'fwd calls':>10} {'real tok':>9} {'pad tok':>8} {'gen tok/s':>10} {'same answers':>13}")
    reference = None
    for batch in (1, max(sizes)):
        g = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=args.max_new_tokens, batch_size=batch))
        _sync(device)
        start = time.perf_counter()
        records = g.generate(dialogues)
        _sync(device)
        wall = time.perf_counter() - start
        answers = [r.answer for r in records]
        reference = reference or answers
        same = sum(a == b for a, b in zip(answers, reference))
        generated = sum(r.new_tokens for r in records)
        print(f"{batch:>4} {wall:>8.1f} {g.stats['forward_calls']:>10,} {g.stats['forward_tokens']:>9,} "
              f"{g.stats['padding_tokens']:>8,} {generated / wall:>10,.0f} {same:>6}/{len(answers)}")


if __name__ == "__main__":
    main()
