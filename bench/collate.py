"""Collator benchmark on a generated llava-665k + MMDU-45k length mix at 8k tokens.

    OMP_NUM_THREADS=1 python bench/collate.py --samples 3000 --timed 60
    OMP_NUM_THREADS=1 python bench/collate.py --family qwen2_vl --samples 3000 --timed 60
    OMP_NUM_THREADS=1 python bench/collate.py --family internvl --samples 3000 --timed 60

Prints, on one CPU core:

1. token utilisation (real tokens / tokens computed incl. padding) of plain padding,
   length grouping and packing at 8k, and beside it the most any packing of these lengths
   can reach (a lower bound on the rows needed);
2. samples/s of the length pass (mmtune: render + tokenize, no pixels) vs the plain HF
   processor path (chat template + processor on the text and every decoded image);
3. collation samples/s (encode + labels + images + batch) mmtune vs the plain HF path on
   the same samples in the same run, cold (no pixel cache) and with the pixel cache;
4. the attention-mask memory of one packed 8k row on the SDPA path.

Data: dialogues shaped like the two sources (llava-665k: 1 image in the first turn, 1-8
short turns, ~10% text-only; MMDU-45k: 2-5 images introduced across ~9 long turns),
mixed 665:45 by sample count, with real JPEG files. The tokenizer is the family's tiny
byte-level BPE.

- ``--family llava`` (default): 800x600 JPEGs; the LLaVA-1.5 processor rebuilt offline
  (CLIP 336 px, 576 tokens per image).
- ``--family qwen2_vl``: JPEGs of 12 photo sizes and aspect ratios (300x300 to 1920x1080,
  a 2000x400 panorama), so image token counts are dynamic: the Qwen2-VL image processor at
  the pixel bounds of QwenLM's fine-tuning defaults (``qwen-vl-finetune``'s argument.py:
  min 28x28x16, max 28x28x576 pixels, i.e. 16 to 576 tokens per image; ``--max-pixels``
  changes the bound). Its HF path is what ``Qwen2VLProcessor`` does (the class itself needs
  torchvision for its video part): the checkpoint's chat template, every image decoded by
  ``load_image`` and run through the image processor, each ``<|image_pad|>`` expanded to its
  grid's token count, the tokenizer on the expanded text.
- ``--family <class>`` (every class of ``mmtune.testing.checkpoints.KINDS``): the ``auto`` family on a checkpoint of that transformers class (``mmtune.testing.checkpoints``) whose
  processor has the released checkpoint's image settings (InternVL3: 448 px tiles, up to 12, 256
  tokens each; LLaVA-OneVision: 384 px anyres, 729 tokens per tile; Gemma 3: 896 px, 256
  tokens; Idefics3: 364 px tiles of a 1456 px image, 169 tokens each; Mistral 3: 1540 px, 14 px
  patches merged 2x2; GLM-4.1V: up to 4096 merged patches; SmolVLM: 512 px tiles of a 2048 px
  image, 64 tokens each; LLaVA-NeXT: 336 px anyres tiles on 5 grids, 576 tokens per tile before
  unpadding; Aya Vision: 364 px tiles, up to 12 plus a thumbnail, 169 tokens each), the photo
  sizes of the qwen2_vl mix.
  The HF path is that processor itself: ``processor(text=apply_chat_template(...), images=...)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image as PILImage  # noqa: E402

from mmtune.data.batching import plan_length_grouped, plan_packing, plan_padding, plan_stats  # noqa: E402
from mmtune.data.collator import CollatorConfig, MultiImageDataset  # noqa: E402
from mmtune.data.dialogue import Dialogue, Image, Turn  # noqa: E402
from mmtune.data.images import ImagePipeline  # noqa: E402
from mmtune.data.lengths import compute_lengths  # noqa: E402
from mmtune.models.config import ModelConfig  # noqa: E402
from mmtune.models.registry import build_adapter  # noqa: E402
from mmtune.testing.checkpoints import KINDS, RELEASED_IMAGE_SETTINGS, save_tiny_checkpoint  # noqa: E402

WORDS = (
    "the shape in image is a red green blue yellow square circle triangle which shows compare two images "
    "first second both colour same different because left right top bottom background object people "
    "scene describe detail texture light dark large small near far between relationship also however"
).split()


def _text(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(WORDS, size=max(1, n_words))
    return " ".join(words).capitalize() + "."


#: photo sizes of the qwen2_vl mix (width, height): common camera, screen and web sizes
PHOTO_SIZES = [(640, 480), (800, 600), (1024, 768), (1280, 720), (500, 375), (333, 500), (1920, 1080), (300, 300),
               (2000, 400), (768, 1024), (1200, 900), (450, 800)]


def make_images(root: str, count: int, seed: int, sizes: list[tuple[int, int]] | None = None) -> list[str]:
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(count):
        size = (800, 600) if sizes is None else sizes[k % len(sizes)]
        # a smooth photo-like field with noise: JPEG sizes close to real photos
        base = rng.integers(0, 255, size=(6, 8, 3), dtype=np.uint8)
        image = PILImage.fromarray(base).resize(size, PILImage.BICUBIC)
        noise = PILImage.effect_noise(size, 24).convert("RGB")
        image = PILImage.blend(image, noise, 0.25)
        path = os.path.join(root, f"img{k:04d}.jpg")
        image.save(path, quality=90)
        paths.append(path)
    return paths


def make_mix(n: int, images: list[str], seed: int) -> list[Dialogue]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if rng.random() < 45 / 710:  # MMDU-45k: 2-5 images over ~9 long turns (~5k tokens)
            n_img = int(rng.integers(2, 6))
            n_turns = int(np.clip(rng.poisson(9), 2, 27))
            turns = []
            introduced = 0
            for t in range(n_turns):
                segments: list = []
                new = n_img - introduced if t == 0 else 0
                if t == 0:
                    new = min(n_img, int(rng.integers(1, n_img + 1)))
                elif introduced < n_img and rng.random() < 0.3:
                    new = 1
                for _ in range(new):
                    introduced += 1
                    segments += [f"Image{introduced}: ", Image(images[int(rng.integers(len(images)))]), ". "]
                segments.append(_text(rng, int(rng.integers(10, 40))))
                turns.append(Turn("user", tuple(segments)))
                turns.append(Turn("assistant", (_text(rng, int(rng.lognormal(4.4, 0.5))),)))
            if introduced < n_img:  # the remaining images arrive in the last user turn
                extra = []
                for _ in range(n_img - introduced):
                    introduced += 1
                    extra += [f"Image{introduced}: ", Image(images[int(rng.integers(len(images)))]), ". "]
                last = turns[-2]
                turns[-2] = Turn("user", tuple(extra) + last.segments)
            out.append(Dialogue(f"mmdu-{i}", "mmdu", tuple(turns)))
        else:  # llava-665k: one image (or none) in the first turn, short exchanges
            n_turns = int(np.clip(rng.geometric(0.45), 1, 8))
            turns = []
            for t in range(n_turns):
                question = _text(rng, int(rng.integers(5, 20)))
                segments = (Image(images[int(rng.integers(len(images)))]), "\n" + question) if (
                    t == 0 and rng.random() > 0.1
                ) else (question,)
                turns.append(Turn("user", segments))
                turns.append(Turn("assistant", (_text(rng, int(rng.lognormal(3.0, 1.0))),)))
            out.append(Dialogue(f"llava-{i}", "llava", tuple(turns)))
    return out


def hf_processor(adapter):
    """The plain HF path: LlavaProcessor = CLIP image processor at 336 + tokenizer + template."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    size = adapter.model_config.vision_config.image_size
    image_processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=adapter.tokenizer,
        patch_size=adapter.model_config.vision_config.patch_size,
        vision_feature_select_strategy="default",
        chat_template=adapter.tokenizer.chat_template,
        num_additional_image_tokens=1,
    )


class QwenProcessorPath:
    """The plain transformers path for a Qwen-VL checkpoint (see the module docstring)."""

    def __init__(self, adapter):
        self.tokenizer = adapter.tokenizer
        self.image_processor = adapter.image_processor
        self.template = adapter.chat_template
        self.merge = int(adapter.image_processor.merge_size)
        self.pad = "<|image_pad|>"

    def __call__(self, text: list[str], images: list | None = None, padding: bool = False, return_tensors=None):
        pixels = self.image_processor(images=images, return_tensors="pt") if images else {}
        grids = iter(pixels["image_grid_thw"].tolist()) if images else iter(())
        expanded = []
        for one in text:
            parts = one.split(self.pad)
            expanded.append(parts[0] + "".join(self.pad * (int(np.prod(next(grids))) // self.merge**2) + part
                                               for part in parts[1:]))
        out = dict(self.tokenizer(expanded, padding=padding, return_tensors=return_tensors))
        out.update(pixels)
        return out

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = False) -> str:
        return self.tokenizer.apply_chat_template(conversation, chat_template=self.template, tokenize=tokenize)


def load_rgb(path: str):
    """A decoded image as the HF path reads it (transformers' ``load_image``: EXIF orientation, RGB)."""
    from transformers.image_utils import load_image

    return load_image(path)


def messages(dialogue: Dialogue) -> list[dict]:
    return [
        {
            "role": t.role,
            "content": [{"type": "image"} if isinstance(s, Image) else {"type": "text", "text": s} for s in t.segments],
        }
        for t in dialogue.turns
    ]


def _special(processor, text: str) -> dict:
    # as the processor's own apply_chat_template: no second BOS when the template renders one
    bos = getattr(getattr(processor, "tokenizer", None), "bos_token", None)
    return {"add_special_tokens": False} if bos is not None and text.startswith(bos) else {}


def hf_encode(processor, dialogue: Dialogue, max_length: int) -> dict:
    text = processor.apply_chat_template(messages(dialogue), tokenize=False)
    images = [load_rgb(image.path) for image in dialogue.images]
    return processor(text=[text], images=images or None, return_tensors="pt", **_special(processor, text))


def hf_collate(processor, dialogues: list[Dialogue], nested: bool = False) -> dict:
    """The processor on a batch; ``nested``: images as one list per sample (Gemma 3 and Idefics3
    need that), one flat list otherwise."""
    texts = [processor.apply_chat_template(messages(d), tokenize=False) for d in dialogues]
    per_sample = [[load_rgb(image.path) for image in d.images] for d in dialogues]
    images = per_sample if nested else [image for sample in per_sample for image in sample]
    return processor(text=texts, images=images if any(per_sample) else None, padding=True, return_tensors="pt",
                     **_special(processor, texts[0]))


def rows_lower_bound(lengths: list[int], max_length: int) -> int:
    """Martello and Toth's L2 lower bound on the rows any packing needs (Martello & Toth,
    "Lower bounds and reduction procedures for the bin packing problem", 1990): at least
    ceil(sum / max_length), and for every threshold a, one row per sample longer than
    max_length - a, one per sample longer than half a row, plus the rows the samples of
    a..half a row need beyond the room those leave."""
    sizes = np.sort(np.asarray([n for n in lengths if n > 0], dtype=np.int64))
    if not len(sizes):
        return 0
    half = max_length / 2
    best = int(-(-sizes.sum() // max_length))
    for a in np.unique(np.concatenate([[0], sizes[sizes <= half]])):
        big = sizes[sizes > max_length - a]
        large = sizes[(sizes > half) & (sizes <= max_length - a)]
        small = sizes[(sizes >= a) & (sizes <= half)]
        left = small.sum() - (len(large) * max_length - large.sum())
        best = max(best, len(big) + len(large) + max(0, int(-(-left // max_length))))
    return best


def packing_bound(order: list[int], lengths: list[int], max_length: int, window: int) -> tuple[float, float]:
    """The best utilisation any packing of these lengths can reach: over the whole data set, and
    packing each window of ``window`` samples on its own (as ``plan_packing`` does)."""
    valid = [i for i in order if lengths[i] > 0]
    total = sum(lengths[i] for i in valid)
    whole = rows_lower_bound([lengths[i] for i in valid], max_length)
    windows = sum(rows_lower_bound([lengths[i] for i in valid[s:s + window]], max_length)
                  for s in range(0, len(valid), window))
    return total / (whole * max_length), total / (windows * max_length)


def rate(fn, items, budget_s: float) -> tuple[float, int]:
    """Items per second of ``fn`` over ``items`` (stops after ``budget_s``)."""
    start = time.perf_counter()
    done = 0
    for item in items:
        fn(item)
        done += 1
        if time.perf_counter() - start > budget_s:
            break
    return done / (time.perf_counter() - start), done


def mask_memory(adapter) -> dict[str, int]:
    """Bytes of the attention mask transformers builds for one packed 8k row."""
    from transformers.masking_utils import create_causal_mask

    cfg = adapter.model_config.get_text_config()
    length = 8192
    lengths = [3000, 2500, 1500, 1000, 192]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    embeds = torch.zeros(1, length, 1)  # only shape / dtype / device are read
    out = {}
    for impl in ("sdpa", "flash_attention_2"):
        cfg._attn_implementation = impl
        try:
            mask = create_causal_mask(
                config=cfg, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=position_ids
            )
            out[impl] = 0 if mask is None else mask.numel() * mask.element_size()
        except Exception as err:  # flash-attn not installed: its mask function is still mask-free
            out[impl] = f"n/a ({type(err).__name__})"
    cfg._attn_implementation = "sdpa"
    out["mmtune_attention_mask"] = 0  # packed batches carry attention_mask=None
    rows = 1 if adapter.position_id_rows == 1 else 1 + adapter.position_id_rows  # M-RoPE: text row + its rows
    out["mmtune_position_ids"] = rows * position_ids.numel() * position_ids.element_size()
    out["dense_float32_4d"] = length * length * 4
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=3000, help="dialogues in the mix")
    parser.add_argument("--images", type=int, default=120, help="distinct 800x600 JPEG files")
    parser.add_argument("--timed", type=int, default=60, help="samples timed on the (slow) HF paths")
    parser.add_argument("--budget", type=float, default=30.0, help="seconds per timed measurement at most")
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=("llava", "qwen2_vl", *KINDS), default="llava",
                        help="llava: fixed 576 tokens per image; qwen2_vl: dynamic counts from each image's size; "
                             "the others: the auto family on that transformers class (released image settings)")
    parser.add_argument("--max-pixels", type=int, default=28 * 28 * 576,
                        help="qwen2_vl: the processor's max_pixels (default: qwen-vl-finetune's, <= 576 tokens)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    work = tempfile.mkdtemp(prefix="mmtune-bench-")
    t0 = time.perf_counter()
    qwen = args.family == "qwen2_vl"
    auto = args.family in KINDS
    images = make_images(work, args.images, args.seed, PHOTO_SIZES if qwen or auto else None)
    dialogues = make_mix(args.samples, images, args.seed)
    if auto:  # the class's own processor with its released image settings
        directory = save_tiny_checkpoint(os.path.join(work, args.family), args.family, weights=False,
                                         released_sizes=True)
        adapter = build_adapter(ModelConfig(family="auto", path=directory))
        counts = [adapter.image_token_count(Image(p)) for p in images]
        shown = (f"{len(images)} JPEGs of {len(PHOTO_SIZES)} sizes, {min(counts)}-{max(counts)} tokens per image "
                 f"(mean {np.mean(counts):.0f}); {type(adapter.processor).__name__} "
                 f"{RELEASED_IMAGE_SETTINGS[args.family]}")
    elif qwen:  # the fine-tuning defaults' bounds; Qwen2.5-VL's classes
        adapter = build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": "qwen2_5_vl"},
                                            min_pixels=28 * 28 * 16, max_pixels=args.max_pixels))
        counts = [adapter.image_token_count(Image(p)) for p in images]
        shown = (f"{len(images)} JPEGs of {len(PHOTO_SIZES)} sizes, {min(counts)}-{max(counts)} tokens per image "
                 f"(mean {np.mean(counts):.0f}) at max_pixels {args.max_pixels}")
    else:
        adapter = build_adapter(ModelConfig(family="llava", image_size=336))  # 576 tokens per image
        shown = f"{len(images)} JPEGs 800x600, 576 tokens per image"
    print(f"data: {len(dialogues)} dialogues ({sum(d.source == 'mmdu' for d in dialogues)} MMDU-shaped), "
          f"{shown}, generated in {time.perf_counter() - t0:.1f}s")

    # 1. token utilisation at 8k ------------------------------------------------------------
    start = time.perf_counter()
    table = compute_lengths(adapter, dialogues, max_length=args.max_length)
    length_pass_s = time.perf_counter() - start
    lengths = table.lengths.tolist()
    kept = [l for l in lengths if l > 0]
    print(f"lengths: mean {np.mean(kept):.0f}, median {np.median(kept):.0f}, max {max(kept)}, "
          f"mmdu mean {np.mean([l for l, d in zip(lengths, dialogues) if d.source == 'mmdu' and l]):.0f}; "
          f"truncation {table.stats}")
    order = list(np.random.default_rng(args.seed).permutation(len(dialogues)))
    for name, plan, row in (
        ("padding (batch 4)", plan_padding(order, lengths, 4), None),
        ("length grouped (batch 4)", plan_length_grouped(order, lengths, 4), None),
        ("packing (8k rows)", plan_packing(order, lengths, args.max_length, window=512), args.max_length),
    ):
        stats = plan_stats(plan, lengths, row)
        print(f"utilisation  {name:26s} {100 * stats['utilization']:6.2f}%  ({int(stats['batches'])} batches)")
    whole, per_window = packing_bound(order, lengths, args.max_length, 512)
    print(f"utilisation  {'packing bound (the data)':26s} {100 * per_window:6.2f}%  packing each window of 512 "
          f"samples on its own, {100 * whole:.2f}% all samples at once (lower bound on rows: Martello-Toth L2); "
          f"{sum(l > args.max_length // 2 for l in kept)} samples over half a row, "
          f"{table.stats.get('truncated', 0)} truncated and {table.stats.get('skipped', 0)} skipped at "
          f"{args.max_length}")

    # 2. length pass ---------------------------------------------------------------------------
    processor = adapter.processor if auto else QwenProcessorPath(adapter) if qwen else hf_processor(adapter)
    timed = dialogues[: args.timed]
    mmdu = [d for d in dialogues if d.source == "mmdu"]

    def ours_rate(samples: list[Dialogue]) -> float:
        """mmtune's length pass on exactly these samples, repeated for at least a second."""
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < 1.0:
            compute_lengths(adapter, samples, max_length=args.max_length)
            done += len(samples)
        return done / (time.perf_counter() - start)

    print(f"length pass  whole mix    mmtune {len(dialogues) / length_pass_s:8.1f} samples/s over all "
          f"{len(dialogues)} samples")
    for name, subset in (("mix", dialogues[: args.timed]), ("MMDU-shaped", mmdu[: args.timed])):
        if not subset:  # a small --samples mix may hold no MMDU-shaped dialogue
            print(f"length pass  {name:12s} no samples")
            continue
        before = ours_rate(subset)
        hf_rate, hf_n = rate(lambda d: len(hf_encode(processor, d, args.max_length)["input_ids"][0]), subset, args.budget)
        ours = (before + ours_rate(subset)) / 2  # before and after: both see the same machine load
        print(f"length pass  {name:12s} mmtune {ours:8.1f} samples/s  |  HF processor {hf_rate:6.1f} samples/s "
              f"(same {hf_n} samples)  ->  {ours / hf_rate:.0f}x")

    # 3. collation ------------------------------------------------------------------------------
    # The three paths take turns on every batch, so load from other processes on this
    # shared machine hits them alike.
    batch = 4
    cache_dir = os.path.join(work, "pixels")
    cold = MultiImageDataset(timed, adapter, CollatorConfig(max_length=args.max_length), image_pipeline=ImagePipeline(adapter))
    cached = MultiImageDataset(
        timed, adapter, CollatorConfig(max_length=args.max_length, image_cache_dir=cache_dir),
        image_pipeline=ImagePipeline(adapter, cache_dir=cache_dir),
    )
    for i in range(len(timed)):  # fill the cache first (an earlier epoch or run)
        cached[i]
    collate_cold, collate_cached = cold.collator(), cached.collator()
    paths = {
        "HF path": lambda idx: hf_collate(processor, [timed[i] for i in idx], nested=auto),
        "mmtune cold": lambda idx: collate_cold([cold[i] for i in idx]),
        "mmtune pixel cache": lambda idx: collate_cached([cached[i] for i in idx]),
    }
    spent = {name: 0.0 for name in paths}
    done = 0
    for start in range(0, len(timed), batch):
        idx = list(range(start, min(len(timed), start + batch)))
        for name, fn in paths.items():
            t = time.perf_counter()
            fn(idx)
            spent[name] += time.perf_counter() - t
        done += len(idx)
        if sum(spent.values()) > 3 * args.budget:
            break
    hf_rate = done / spent["HF path"]
    print(f"collation    {'HF path':18s} {hf_rate:7.1f} samples/s/core ({done} samples, batches of {batch})")
    for name in ("mmtune cold", "mmtune pixel cache"):
        value = done / spent[name]
        print(f"collation    {name:18s} {value:7.1f} samples/s/core  ->  {value / hf_rate:.1f}x")

    # 4. attention-mask memory -------------------------------------------------------------------
    memory = mask_memory(adapter)
    mib = {k: (f"{v / 2**20:.2f} MiB" if isinstance(v, int) else v) for k, v in memory.items()}
    print(f"mask memory per packed 8k row: {mib}")


if __name__ == "__main__":
    main(sys.argv[1:])
