"""Benchmark: read + validate an MMDU-45k-shaped file cold, then from the Arrow cache.

    python bench/data_load.py                 # 45,000 dialogues (~0.5 GB JSON), a few minutes
    python bench/data_load.py --n 2000        # quick iteration

The generated file has MMDU-45k's shape: 2-5 images (mean 3) and 5-13 user turns
(mean 9) per dialogue, images introduced across turns with ``<ImageHere>``, user
turns of ~300 and answers of ~800 characters. Images are a small pool of shared tiny
PNG files and validation runs with ``check_images=exists`` (each distinct path is
checked once), so the figures measure JSON reading, conversion, dialogue checks and
the Arrow cache, not image decoding.

Each phase runs in its own process so its peak RSS is its own. The two timed against
each other do the same work, every record in hand as a ``Dialogue``:

- cold: ``load_source(refresh=True)`` (parse, convert, validate, write the cache), then
  every record read back as a ``Dialogue``;
- cached: ``load_source()`` on the warm cache, then every record read as a ``Dialogue``.

The goal (exit status 0) is cold >= 10x cached. For reference it also times ``open``:
``load_source()`` alone, which maps the Arrow file and reads the report but no record.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

WORDS = (
    "the image shows a large red building near river with people walking along street while sky is "
    "clear blue and trees line both sides of road compared to second picture which depicts smaller "
    "structure surrounded by mountains snow covered peaks historic architecture modern design colours "
    "texture light shadow detail composition background foreground visible notable feature"
).split()


def _text(rng: random.Random, n_chars: int) -> str:
    words, size = [], 0
    while size < n_chars:
        w = rng.choice(WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words).capitalize() + "."


def generate(path: str, pics: str, n: int, seed: int, user_chars: int, assistant_chars: int) -> None:
    from PIL import Image

    os.makedirs(pics, exist_ok=True)
    pool = []
    for k in range(16):
        name = f"pool_{k}.png"
        Image.new("RGB", (16, 16), (k * 15, 80, 200 - k * 10)).save(os.path.join(pics, name))
        pool.append(name)
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        for i in range(n):
            n_img = rng.choice((2, 3, 3, 4))  # mean 3, like MMDU-45k
            n_turns = rng.randint(5, 13)  # mean 9
            intro_at = sorted([0] + [rng.randrange(n_turns) for _ in range(n_img - 1)])
            conv, k = [], 0
            for t in range(n_turns):
                intro = ""
                for _ in range(intro_at.count(t)):
                    k += 1
                    intro += f"Image{k}: <ImageHere>. "
                user = intro + _text(rng, rng.randint(user_chars // 2, user_chars * 3 // 2)) + f" What about Image{rng.randint(1, max(k, 1))}?"
                conv.append({"from": "user", "value": user})
                conv.append({"from": "assistant", "value": _text(rng, rng.randint(assistant_chars // 2, assistant_chars * 3 // 2))})
            record = {"id": f"bench-{i:06d}", "image": [rng.choice(pool) for _ in range(n_img)], "conversations": conv}
            f.write(("," if i else "") + json.dumps(record, ensure_ascii=False) + "\n")
        f.write("]\n")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_split_mb() -> dict[str, float]:
    """Current anonymous vs file-backed resident memory (Linux). Pages of the
    memory-mapped Arrow cache count in RSS as file-backed: page cache the kernel can
    drop, not a copy of the data in Python memory."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    key, value = line.split(":")
                    out[key] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


def phase(name: str, path: str, pics: str, cache: str) -> None:
    """Run one phase in this process and print a JSON line with its figures."""
    from mmtune.data.config import SourceConfig
    from mmtune.data.readers import load_source

    base_rss = _peak_rss_mb()
    cfg = SourceConfig(name="bench", format="mmdu", path=path, image_root=pics)
    start = time.perf_counter()
    src = load_source(cfg, cache_dir=cache, check_images="exists", refresh=name == "cold")
    if name != "open":  # every record as a Dialogue
        n_img = sum(d.num_images for d in src.dialogues)
        assert n_img == src.report.images, (n_img, src.report.images)
    seconds = time.perf_counter() - start
    print(json.dumps({
        "phase": name,
        "records": src.report.records_read,
        "kept": src.report.records_kept,
        "seconds": seconds,
        "records_per_s": src.report.records_read / seconds,
        "peak_rss_mb": _peak_rss_mb(),
        "rss_after_imports_mb": base_rss,
        "rss_now_mb": _rss_split_mb(),
        "turns": src.report.turns,
        "images": src.report.images,
    }))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=45_000, help="dialogues to generate")
    p.add_argument("--dir", help="work folder (default: a temporary one, deleted afterwards)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--user-chars", type=int, default=300)
    p.add_argument("--assistant-chars", type=int, default=800)
    p.add_argument("--phase", choices=("cold", "cached", "open"), help=argparse.SUPPRESS)
    args = p.parse_args()

    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="mmtune-bench-")
    work = args.dir or tmp.name
    path, pics, cache = (os.path.join(work, x) for x in ("mmdu-45k-bench.json", "pics", "cache"))
    if args.phase:
        phase(args.phase, path, pics, cache)
        return 0

    os.makedirs(work, exist_ok=True)
    if not os.path.exists(path):
        t = time.perf_counter()
        generate(path, pics, args.n, args.seed, args.user_chars, args.assistant_chars)
        print(f"generated {args.n} dialogues, {os.path.getsize(path) / 1e6:.0f} MB in {time.perf_counter() - t:.1f}s: {path}")
    else:
        print(f"reusing {path} ({os.path.getsize(path) / 1e6:.0f} MB)")
    results = {}
    for name in ("cold", "cached", "open"):
        out = subprocess.run(
            [sys.executable, __file__, "--phase", name, "--dir", work],
            check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
        results[name] = r = json.loads(out)
        print(f"{name:<7} {r['records']:>7} records  {r['seconds']:8.2f} s  {r['records_per_s']:>12,.0f} records/s  "
              f"peak RSS {r['peak_rss_mb']:.0f} MB (after imports {r['rss_after_imports_mb']:.0f} MB; at end: "
              + ", ".join(f"{k} {v:.0f} MB" for k, v in r["rss_now_mb"].items()) + ")")
    cold, cached = results["cold"], results["cached"]
    ratio = cold["seconds"] / cached["seconds"]
    print(f"turns {cold['turns']}, images {cold['images']}, kept {cold['kept']}")
    print(f"reading every record: cached {ratio:.1f}x faster than cold (goal >= 10x: {'met' if ratio >= 10 else 'NOT met'}); "
          f"opening the cache without reading records: {results['open']['seconds']:.2f} s")
    if tmp is not None:
        tmp.cleanup()
    return 0 if ratio >= 10 else 1


if __name__ == "__main__":
    sys.exit(main())
