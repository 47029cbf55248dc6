"""A small generated corpus for trying the builder: coloured shapes in a few categories.

    python -m mmtune.data.build.demo_corpus OUT_DIR [--entries 24] [--seed 0]

Writes ``OUT_DIR/corpus.jsonl`` and ``OUT_DIR/images/*.png``. Entries of one category
share tags and caption words, so the clustering has real groups to find.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
# Each shape stands for a topic with its own vocabulary, as real corpus categories have.
TOPICS = {
    "circle": ("astronomy", "planet", "a planet seen through a telescope, its round disc against the night sky"),
    "square": ("architecture", "building", "a modern office building facade with square windows"),
    "triangle": ("mountaineering", "mountain", "a steep alpine mountain peak above the tree line"),
}


def _draw(shape: str, rgb: tuple[int, int, int], size: int, rng: random.Random):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (250, 250, 250))
    d = ImageDraw.Draw(img)
    m = rng.randint(4, size // 4)
    box = (m, m, size - m, size - m)
    if shape == "circle":
        d.ellipse(box, fill=rgb)
    elif shape == "square":
        d.rectangle(box, fill=rgb)
    else:
        d.polygon([(size // 2, m), (size - m, size - m), (m, size - m)], fill=rgb)
    return img


def generate_corpus(out_dir: str | Path, entries: int = 24, images_per_entry: int = 2, image_size: int = 56,
                    seed: int = 0) -> Path:
    """Write the corpus; returns the path of ``corpus.jsonl``."""
    rng = random.Random(seed)
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    categories = [(c, s) for s in SHAPES for c in COLOURS]
    lines = []
    for i in range(entries):
        colour, shape = categories[i % len(categories)]
        paths, captions = [], []
        for k in range(images_per_entry):
            name = f"images/e{i:04d}_{k}.png"
            _draw(shape, COLOURS[colour], image_size, rng).save(out / name)
            paths.append(name)
            captions.append(f"{TOPICS[shape][2]}, tinted {colour} ({shape}), photo {k + 1}")
        topic, noun, _ = TOPICS[shape]
        lines.append({
            "id": f"e{i:04d}", "images": paths, "captions": captions,
            "tags": [topic, f"{colour} {noun}s", f"{topic} pictures"],
            "text": f"Entry {i} is about a {colour} {noun} in the {topic} collection; it is drawn as a {shape}.",
        })
    path = out / "corpus.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--entries", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(generate_corpus(args.out_dir, args.entries, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
