"""Benchmark: time to the first optimizer step on the paper's data mix, this tree beside an older commit.

    python bench/data_scale.py --n 665000 --n-mmdu 45000      # the paper's sizes (hours on 2 cores)
    python bench/data_scale.py --n 20000 --n-mmdu 2000        # minutes
    python bench/data_scale.py --n 10000000 --n-mmdu 0 --only head --ranks 1 --kinds cold --jsonl-shards 20
        # a 10M-record mix as 20 JSONL shards

It generates a mix shaped like the paper's own data (``data=add_to_pool``): a
llava-665k-shaped JSON list (COCO records named by their image id, several conversations per
id across sub-sets, as the real file repeats them; GQA / OCR-VQA / TextVQA / VG records; a
text-only share) and an MMDU-45k-shaped one (2-5 images, ~9 turns), plus a Parquet copy of
the llava part with its images embedded as bytes (the Hugging Face ``Image`` feature) in
hub-style shards. Images are a small pool of distinct tiny JPEGs. Generation is not timed.

Then, for this tree (``head``) and the commit before the data-scale work (``base``, checked
out by the bench into a temporary ``git worktree``), side by side in one run, it launches
``recipes/sft.py``'s lifecycle on the tiny LLaVA with ``collator=packing_8k`` and
``training.max_steps=1``, for 1 process and for 2 gloo ranks (``torchrun``), cold (empty
caches) and warm (a second launch, no other setting), and prints per phase: reading and
caching, the length pass, the batch plan, and the wall time from the launch to the end of
the first optimizer step (interpreter start and imports included), and the peak RSS of
every rank (VmHWM; its forked length-pass workers apart) with, at the end, its private
memory and its mapped file pages (libraries and the memory-mapped Arrow cache). Last, ``head`` trains the first step on
the Parquet copy and on the JSON and prints both losses.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_COMMIT = "39b30ce"
COCO_SETS = ("conversation", "detail", "reasoning", "vqav2", "okvqa")
WORDS = ("the image shows a large red building near river with people walking along street while sky is clear "
         "blue and trees line both sides of road compared to second picture which depicts smaller structure").split()

# Runs inside each launched process (any rank); times the phases by wrapping the functions the
# data module calls, which both trees have.
DRIVER = r"""
import json, os, sys, time
T0 = float(os.environ["BENCH_T0"])
phases = {}
def timed(name, owner, attr):
    inner = getattr(owner, attr)
    def wrapper(*args, **kwargs):
        t = time.time()
        try:
            return inner(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + time.time() - t
    setattr(owner, attr, wrapper)
import mmtune.data.datamodule as dm, mmtune.data.loss_report as lr, mmtune.data.mixture as mx
timed("read_cache", mx, "build_mixture"); timed("lengths", lr, "lengths_per_source")
timed("plan", dm.SFTDataModule, "_global_plan")
try:  # a windowed plan measures as it plans (this tree); the older one has no such module
    import mmtune.data.windowed as wd
    timed("lengths", wd.MeasuredLengths, "ensure")
except ImportError:
    pass
from mmtune.training.config import to_sft_config
from mmtune.training.demo import compose_sft_config
from mmtune.training.loop import SFTRecipe
recipe = SFTRecipe(to_sft_config(compose_sft_config(json.loads(os.environ["BENCH_OVERRIDES"]))))
recipe.setup()
recipe.train()
first_step = time.time() - T0
rank = int(os.environ.get("RANK", "0"))
metrics = [json.loads(l) for l in open(os.path.join(recipe.output_dir, "metrics.jsonl"))] if rank == 0 else []
out = {"rank": rank, "first_step_s": first_step, "phases": phases,
       # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across execve, so a launched process would report
       # the bench's own peak (generating the records) when it is higher
       "rss_mb": next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024,
       # of it, at the end: private memory, and the file pages mapped (libraries, the memory-mapped Arrow cache:
       # shared by the ranks, dropped by the kernel under pressure; random record reads fault in pages around each)
       "anon_mb": next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) / 1024,
       "file_mb": next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssFile")) / 1024,
       "loss": metrics[0].get("train/loss") if metrics else None, "samples": int(len(recipe.data.lengths))}
with open(os.environ["BENCH_OUT"] + f".rank{rank}.json", "w") as f:
    json.dump(out, f)
"""


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _jpeg(colour: tuple[int, int, int], size: int = 32) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="JPEG")
    return out.getvalue()


def _llava_records(n: int, rng: random.Random, pool: int):
    """llava-665k-shaped records in the real file's order: sub-set by sub-set, COCO ids repeated."""
    n_coco = int(n * 364100 / 665298)
    per_set = max(1, n_coco // len(COCO_SETS))
    for name in COCO_SETS:
        for k in range(per_set):
            image_id = f"{k % max(1, per_set):012d}"
            turns = 3 if name == "conversation" else 1
            conv = []
            for t in range(turns):
                question = _text(rng, 12) + (f" ({name})" if t else "")
                conv += [{"from": "human", "value": ("<image>\n" if t == 0 else "") + question},
                         {"from": "gpt", "value": _text(rng, 40 if name != "vqav2" else 2)}]
            yield {"id": image_id, "image": f"coco/train2017/{k % pool:012d}.jpg", "conversations": conv}
    for k in range(n - per_set * len(COCO_SETS)):
        if k % 6 == 5:  # the text-only share (ShareGPT)
            yield {"id": f"sg_{k}", "conversations": [{"from": "human", "value": _text(rng, 30)},
                                                      {"from": "gpt", "value": _text(rng, 120)}]}
            continue
        yield {"id": f"gqa_{k}", "image": f"gqa/images/{k % pool}.jpg",
               "conversations": [{"from": "human", "value": "<image>\n" + _text(rng, 10)},
                                 {"from": "gpt", "value": _text(rng, 3)}]}


def _mmdu_records(n: int, rng: random.Random, pool: int):
    for k in range(n):
        images = rng.randint(2, 5)
        conv = [{"from": "user", "value": " ".join(f"Image{i + 1}: <ImageHere>." for i in range(images))
                 + " " + _text(rng, 40)}, {"from": "assistant", "value": _text(rng, 150)}]
        for _ in range(rng.randint(5, 13) - 1):
            conv += [{"from": "user", "value": _text(rng, 40)}, {"from": "assistant", "value": _text(rng, 150)}]
        yield {"id": f"mmdu_{k}", "image": [f"{(k + i) % pool}.jpg" for i in range(images)], "conversations": conv}


def _write_json_list(path: Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        for k, record in enumerate(records):
            f.write((",\n" if k else "") + json.dumps(record))
        f.write("\n]\n")


def _write_parquet(llava_json: Path, folder: Path, image_root: Path, shards: int) -> None:
    """The llava part as hub-style Parquet shards with every image embedded as bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = json.loads(llava_json.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    schema = pa.schema([("id", pa.string()), ("image", image_type), ("conversations", pa.list_(turn))])
    per = -(-len(records) // shards)
    for s in range(shards):
        rows = records[s * per:(s + 1) * per]
        images = [{"bytes": (image_root / r["image"]).read_bytes(), "path": r["image"]} if "image" in r else None
                  for r in rows]
        table = pa.table({"id": [r["id"] for r in rows], "image": images,
                          "conversations": [r["conversations"] for r in rows]}, schema=schema)
        pq.write_table(table, folder / f"train-{s:05d}-of-{shards:05d}.parquet")


def _write_jsonl_shards(folder: Path, records, shards: int, n: int) -> None:
    """``records`` (``n`` of them) as ``part-0000k.jsonl`` shards of equal size, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-n // shards)
    out = None
    for k, record in enumerate(records):
        if k % per == 0:
            if out:
                out.close()
            out = open(folder / f"part-{k // per:05d}.jsonl", "w", encoding="utf-8")
        out.write(json.dumps(record) + "\n")
    if out:
        out.close()


def generate(root: Path, n: int, n_mmdu: int, pool: int, parquet: bool, jsonl_shards: int = 0) -> None:
    rng = random.Random(0)
    for k in range(pool):
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        for rel in (f"llava/coco/train2017/{k:012d}.jpg", f"llava/gqa/images/{k}.jpg", f"mmdu/mmdu-45k_pics/{k}.jpg"):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(_jpeg(colour))
    if jsonl_shards:  # the llava part as JSONL shards instead of one JSON list (no Parquet copy)
        _write_jsonl_shards(root / "llava", _llava_records(n, rng, pool), jsonl_shards, n)
        parquet = False
    else:
        _write_json_list(root / "llava" / "llava_v1_5_mix665k.json", _llava_records(n, rng, pool))
    _write_json_list(root / "mmdu" / "mmdu-45k.json", _mmdu_records(n_mmdu, rng, pool))
    if parquet:
        _write_parquet(root / "llava" / "llava_v1_5_mix665k.json", root / "llava_parquet" / "data", root / "llava",
                       shards=max(1, n // 50000))


def _overrides(out: Path, cache: Path, files: list[str] | None) -> list[str]:
    common = ["model=llava_tiny", "data=add_to_pool", "collator=packing_8k", "context=8k", "training.max_steps=1",
              "training.epochs=1", f"training.output_dir={out}", f"data.cache_dir={cache}",
              "training.eval_before=false", "training.eval_after=false", "training.save_final=false",
              "logging.progress_bar=false", "training.gradient_checkpointing=false"]
    if files:
        common.append("data.files=[" + ",".join(files) + "]")
    return common


def launch(tree: Path, ranks: int, out: Path, cache: Path, data_root: Path, files: list[str] | None = None) -> dict:
    """One launch of the driver in ``tree`` on ``ranks`` processes; rank 0's figures and every rank's RSS."""
    driver = out.parent / f"{out.name}.driver.py"
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "MMTUNE_DATA_ROOT": str(data_root), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline",
           "BENCH_OUT": str(out), "BENCH_OVERRIDES": json.dumps(_overrides(out, cache, files))}
    cmd = [sys.executable, str(driver)] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
        str(29500 + random.randrange(2000)), str(driver)]
    env["BENCH_T0"] = str(time.time())
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree} ({ranks} rank(s)) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    found = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]
    return {**found[0], "rss_mb": [r["rss_mb"] for r in found], "anon_mb": [r.get("anon_mb", 0) for r in found],
            "file_mb": [r.get("file_mb", 0) for r in found]}


def _base_tree(tmp: Path, commit: str) -> Path:
    tree = tmp / f"base-{commit}"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True,
                   capture_output=True)
    return tree


def _row(name: str, r: dict) -> str:
    p = r["phases"]
    return (f"{name:<24} {r['first_step_s']:>9.1f} {p.get('read_cache', 0):>9.1f} {p.get('lengths', 0):>9.1f} "
            f"{p.get('plan', 0):>8.1f}  {'/'.join(f'{m:.0f}' for m in r['rss_mb']):>12}"
            f"  {'/'.join(f'{a:.0f}+{f:.0f}' for a, f in zip(r['anon_mb'], r['file_mb'])):>16}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=665000, help="llava-665k-shaped records")
    ap.add_argument("--n-mmdu", type=int, default=45000, help="MMDU-45k-shaped records")
    ap.add_argument("--images", type=int, default=64, help="distinct images in the pool")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--only", choices=("head", "base"), help="run one side only")
    ap.add_argument("--kinds", nargs="+", choices=("cold", "warm"), default=["cold", "warm"],
                    help="launches per side (cold alone: the older side's full-size warm launch takes 15+ minutes)")
    ap.add_argument("--no-files", action="store_true", help="skip the Parquet / data.files runs of this tree")
    ap.add_argument("--base", default=BASE_COMMIT, help="the commit compared with (default: before this work)")
    ap.add_argument("--work", help="folder for data and runs (default: a temporary one, removed)")
    ap.add_argument("--jsonl-shards", type=int, default=0, metavar="K",
                    help="write the llava part as K JSONL shards, read through data.files (this tree only)")
    args = ap.parse_args(argv)
    if args.jsonl_shards and args.only != "head":
        ap.error("--jsonl-shards reads a glob of shards, which the older commit cannot: add --only head")
    tmp = Path(args.work or tempfile.mkdtemp(prefix="data_scale-"))
    data = tmp / "data"
    t = time.time()
    shape = {"n": args.n, "n_mmdu": args.n_mmdu, "images": args.images, "jsonl_shards": args.jsonl_shards,
             "parquet": args.only != "base" and not args.no_files and not args.jsonl_shards}
    marker = data / "generated.json"
    if marker.exists() and json.loads(marker.read_text()) == shape:  # a --work folder of the same mix
        print(f"using the {args.n} + {args.n_mmdu} records generated earlier under {data}")
    else:
        shutil.rmtree(data, ignore_errors=True)
        generate(data, args.n, args.n_mmdu, args.images, parquet=shape["parquet"], jsonl_shards=args.jsonl_shards)
        marker.write_text(json.dumps(shape))
        print(f"generated {args.n} llava-shaped + {args.n_mmdu} MMDU-shaped records in {time.time() - t:.0f} s "
              f"(not counted) under {data}")
    shutil.rmtree(tmp / "runs", ignore_errors=True)  # an earlier bench's launches in a reused --work folder
    trees: dict[str, Path] = {} if args.only == "base" else {"head": REPO}
    if args.only != "head":
        trees["base"] = _base_tree(tmp, args.base)
    results: dict[str, dict] = {}
    try:
        for ranks in args.ranks:
            for side, tree in sorted(trees.items()):
                cache = tmp / "runs" / f"{side}-{ranks}" / "cache"
                files = None
                if args.jsonl_shards:
                    files = [str(data / "llava" / "part-*.jsonl")]  # beside the images: the default image root
                    files += [str(data / "mmdu" / "mmdu-45k.json")] if args.n_mmdu else []
                for launch_kind in args.kinds:
                    name = f"{side} {ranks}r {launch_kind}"
                    results[name] = launch(tree, ranks, tmp / "runs" / f"{side}-{ranks}" / launch_kind, cache, data,
                                           files)
                    print(_row(name, results[name]), flush=True)
        if "head" in trees and not args.no_files and not args.jsonl_shards:
            llava = str(data / "llava" / "llava_v1_5_mix665k.json")
            mmdu = str(data / "mmdu" / "mmdu-45k.json")
            pq_glob = str(data / "llava_parquet" / "data" / "train-*.parquet")
            files_json = launch(REPO, 1, tmp / "runs" / "files-json" / "run", tmp / "runs" / "files-json" / "cache",
                                data, [llava, mmdu] if args.n_mmdu else [llava])
            files_pq = launch(REPO, 1, tmp / "runs" / "files-pq" / "run", tmp / "runs" / "files-pq" / "cache",
                              data, [pq_glob, mmdu] if args.n_mmdu else [pq_glob])
            results["head parquet"], results["head json files"] = files_pq, files_json
            print(_row("head parquet cold", files_pq))
            print(f"first-step loss: JSON {files_json['loss']}, Parquet {files_pq['loss']} "
                  f"({'equal' if files_json['loss'] == files_pq['loss'] else 'DIFFERENT'})")
    finally:
        if "base" in trees:
            subprocess.run(["git", "worktree", "remove", "--force", str(trees["base"])], cwd=REPO, capture_output=True)
        if not args.work:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'run':<24} {'1st step':>9} {'read':>9} {'lengths':>9} {'plan':>8}  {'RSS MB/rank':>12}  {'end: anon+file':>16}")
    for name, r in results.items():
        print(_row(name, r))
    for ranks in args.ranks:
        for kind in ("cold", "warm"):
            b, h = results.get(f"base {ranks}r {kind}"), results.get(f"head {ranks}r {kind}")
            if b and h:
                print(f"{ranks} rank(s) {kind}: head / base time to first step = "
                      f"{h['first_step_s'] / b['first_step_s']:.3f} ({h['first_step_s']:.1f} s / {b['first_step_s']:.1f} s); "
                      f"samples head {h['samples']}, base {b['samples']}")
    print(json.dumps({"n": args.n, "n_mmdu": args.n_mmdu, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
