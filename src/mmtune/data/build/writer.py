"""Merging shards into the final dataset, with its images, data config and stats report.

The result reads as is: ``mmdu.json`` is MMDU format with image paths relative to
``images/``; ``data.yaml`` is a data config for ``mmtune data check`` and the training
recipes; the merged file is read back through the MMDU reader with every image
verified before the merge reports success.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import numpy as np

from mmtune.data.build.config import BuildConfig
from mmtune.data.build.pipeline import BuildError, shard_of
from mmtune.data.readers import MMDU_PLACEHOLDER
from mmtune.io.nofollow import open_output, save_figure, write_output_text


def _image_name(path: str) -> str:
    ext = os.path.splitext(path)[1].lower() or ".img"
    return hashlib.sha1(os.path.abspath(path).encode("utf-8")).hexdigest()[:16] + ext


def _place_image(src: str, dst: Path, mode: str) -> None:
    # a link in images/ is ours only in symlink mode; in the other modes copying onto it
    # would write its target, so the copy refuses it (io/nofollow.py)
    if os.path.lexists(dst) and (mode == "symlink" or not dst.is_symlink()):
        return
    if mode == "symlink":
        os.symlink(os.path.abspath(src), dst)
    elif mode == "hardlink":
        try:
            os.link(src, dst)
        except OSError:  # another file system: copy instead
            _copy(src, dst)
    else:
        _copy(src, dst)


def _copy(src: str, dst: Path) -> None:
    """``shutil.copy2`` that never writes through a link at ``dst``."""
    with open(src, "rb") as source, open_output(dst, "wb") as target:
        shutil.copyfileobj(source, target)
    shutil.copystat(src, dst)


def _scan_jsonl(path: Path):
    """``(byte offset, record)`` of every complete line (a line cut off by a kill is skipped)."""
    if not path.is_file():
        return
    offset = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict) and "id" in record:
                yield offset, record
            offset += len(line)


def estimate_tokens(record: dict[str, Any], tokens_per_image: int) -> int:
    """Characters / 4 plus ``tokens_per_image`` per image (no tokenizer needed)."""
    chars = sum(len(m["value"].replace(MMDU_PLACEHOLDER, "")) for m in record["conversations"])
    return chars // 4 + tokens_per_image * len(record["image"])


def _describe(values: list[int]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    a = np.asarray(values)
    return {"count": int(a.size), "mean": float(a.mean()), "min": int(a.min()), "p50": float(np.median(a)),
            "p95": float(np.percentile(a, 95)), "max": int(a.max())}


def _plot_tokens(tokens: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(tokens, bins=min(50, max(5, len(tokens) // 4)), color="#4477aa")
    ax.set_xlabel("estimated tokens per dialogue (text chars / 4 + tokens per image)")
    ax.set_ylabel("dialogues")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def _read_plan(plan_dir: Path) -> tuple[dict[str, Any], list[str], dict[str, int]]:
    """``(plan.json, set ids in plan order, cluster of each set id)`` of the plan stage's output.

    Raises:
        BuildError: the plan stage has not run.
    """
    if not (plan_dir / "sets.jsonl").is_file():
        raise BuildError(f"{plan_dir} has no plan: run `mmtune data build CONFIG --stage plan` first")
    plan_info = json.loads((plan_dir / "plan.json").read_text())
    sets = [json.loads(line) for line in (plan_dir / "sets.jsonl").read_text().splitlines() if line.strip()]
    return plan_info, [d["id"] for d in sets], {d["id"]: d["cluster"] for d in sets}


def _scan_shards(shards_dir: Path, n_shards: int) -> tuple[dict[str, tuple[Path, int]], Counter, list[dict]]:
    """``(where, rejected, shard_stats)`` of the shard folders: the file and byte offset of each
    dialogue by set id, the rejected sets counted by reason, and each shard's ``stats.json``.

    Only ids and byte offsets are held: the dialogues are read back one at a time while the
    merged file is written, so a merge of any size needs memory for its ids alone.

    Raises:
        BuildError: a shard folder is missing.
    """
    where: dict[str, tuple[Path, int]] = {}
    rejected: Counter = Counter()
    shard_stats: list[dict] = []
    missing_shards = []
    for i in range(n_shards):
        folder = shards_dir / f"{i}-of-{n_shards}"
        if not folder.is_dir():
            missing_shards.append(i)
            continue
        for offset, r in _scan_jsonl(folder / "dialogues.jsonl"):
            where[r["id"]] = (folder / "dialogues.jsonl", offset)
        for _, r in _scan_jsonl(folder / "rejected.jsonl"):
            rejected[r["reason"]] += 1
        if (folder / "stats.json").is_file():
            shard_stats.append(json.loads((folder / "stats.json").read_text()))
    if missing_shards:
        raise BuildError(
            f"shard folder(s) {missing_shards} of {n_shards} are missing under {shards_dir}: run "
            f"`mmtune data build CONFIG --shard i/{n_shards}` for each, or merge with the shard count used"
        )
    return where, rejected, shard_stats


def _write_dialogues(cfg: BuildConfig, ids: list[str], where: dict[str, tuple[Path, int]],
                     cluster_of: dict[str, int], images_dir: Path) -> dict[str, list[int]]:
    """Write ``mmdu.json`` (through a temporary file) with the dialogues ``ids`` in that order,
    each read back from its shard, its images placed in ``images_dir`` under names hashed
    from their source paths.

    Returns:
        lists for the stats: ``tokens``, ``images`` and ``turns`` with one entry per
        dialogue, ``per_cluster`` with the number of dialogues of each cluster.
    """
    out = Path(cfg.output.dir)
    tmp = out / "mmdu.json.tmp"
    tokens: list[int] = []
    n_images: list[int] = []
    n_turns: list[int] = []
    per_cluster: Counter = Counter()
    handles: dict[Path, Any] = {}
    try:
        with open_output(tmp, "w") as f:
            f.write("[")
            for k, sid in enumerate(ids):
                path, offset = where[sid]
                if path not in handles:
                    handles[path] = open(path, "rb")
                handles[path].seek(offset)
                r = json.loads(handles[path].readline())
                names = []
                for p in r["image"]:
                    name = _image_name(p)
                    _place_image(p, images_dir / name, cfg.output.images)
                    names.append(name)
                r = {**r, "image": names}
                f.write(("\n" if k == 0 else ",\n") + json.dumps(r, ensure_ascii=False))
                tokens.append(estimate_tokens(r, cfg.output.tokens_per_image))
                n_images.append(len(names))
                n_turns.append(len(r["conversations"]) // 2)
                per_cluster[cluster_of.get(sid, -1)] += 1
            f.write("\n]\n")
    finally:
        for h in handles.values():
            h.close()
    os.replace(tmp, out / "mmdu.json")
    return {"tokens": tokens, "images": n_images, "turns": n_turns, "per_cluster": list(per_cluster.values())}


def _write_data_config(cfg: BuildConfig, images_dir: Path) -> None:
    """Write ``data.yaml``: a data config that reads the merged dataset in strict mode."""
    out = Path(cfg.output.dir)
    write_output_text(out / "data.yaml",
        "# mmtune data check " + str(out / "data.yaml") + " --strict\n"
        "# The dataset written by `mmtune data build`: MMDU format, images under images/.\n"
        "mixture:\n  sources:\n"
        f"    - name: built\n      format: mmdu\n      path: {json.dumps(str((out / 'mmdu.json').resolve()))}\n"
        f"      image_root: {json.dumps(str(images_dir.resolve()))}\n"
        "validation:\n  mode: strict\n  check_images: verify\n"
        + (_SYMLINK_NOTE if cfg.output.images == "symlink" else ""),
        encoding="utf-8",
    )


def _sum_runs(shard_stats: list[dict]) -> dict[str, dict]:
    """``repairs``, ``dropped_pairs`` and (numeric) ``teacher`` counts summed over every run of every shard."""
    repairs: Counter = Counter()
    dropped: Counter = Counter()
    teacher: Counter = Counter()
    for s in (run for shard in shard_stats for run in shard.get("runs", [])):
        repairs.update(s.get("repairs", {}))
        dropped.update(s.get("dropped_pairs", {}))
        teacher.update({k: v for k, v in s.get("teacher", {}).items() if isinstance(v, (int, float))})
    return {"repairs": dict(repairs), "dropped_pairs": dict(dropped), "teacher": dict(teacher)}


def merge(cfg: BuildConfig, n_shards: int, *, allow_incomplete: bool = True) -> dict[str, Any]:
    """Merge ``n_shards`` shard folders into the dataset; returns the stats written to ``stats.json``.

    Raises:
        BuildError: no plan, a shard folder is missing, or (``allow_incomplete=False``)
            sets are still unfinished.
    """
    out = Path(cfg.output.dir)
    plan_info, order, cluster_of = _read_plan(out / "plan")
    where, rejected, shard_stats = _scan_shards(out / "shards", n_shards)
    unfinished = len(order) - len(where) - sum(rejected.values())
    if unfinished and not allow_incomplete:
        raise BuildError(f"{unfinished} image sets have no dialogue yet: re-run the shards (they resume) and merge again")
    position = {sid: k for k, sid in enumerate(order)}
    ids = sorted(where, key=lambda sid: position.get(sid, len(position)))

    images_dir = out / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    per_dialogue = _write_dialogues(cfg, ids, where, cluster_of, images_dir)
    _write_data_config(cfg, images_dir)
    stats = {
        "dialogues": len(ids),
        "sets_planned": len(order),
        "sets_rejected": dict(rejected),
        "sets_unfinished": unfinished,
        "images_per_dialogue": _describe(per_dialogue["images"]),
        "turns_per_dialogue": _describe(per_dialogue["turns"]),
        "tokens_per_dialogue_estimate": _describe(per_dialogue["tokens"]),
        "dialogues_per_cluster": _describe(per_dialogue["per_cluster"]),
        "clusters": plan_info.get("clusters", {}),
        "corpus": plan_info.get("corpus", {}),
        **_sum_runs(shard_stats),
    }
    write_output_text(out / "stats.json", json.dumps(stats, indent=1))
    write_output_text(out / "stats.md", render_stats(stats))
    if per_dialogue["tokens"]:
        _plot_tokens(per_dialogue["tokens"], out / "tokens_per_dialogue.png")
    return stats


def render_stats(stats: dict[str, Any]) -> str:
    """The stats as a short Markdown report."""

    def row(name: str, d: dict) -> str:
        if not d.get("count"):
            return f"| {name} | 0 | | | | | |"
        return f"| {name} | {d['count']} | {d['mean']:.1f} | {d['min']} | {d['p50']:.0f} | {d['p95']:.0f} | {d['max']} |"

    c = stats.get("clusters", {})
    lines = [
        "# Built dataset",
        "",
        f"dialogues {stats['dialogues']} of {stats['sets_planned']} image sets planned; "
        f"rejected {sum(stats['sets_rejected'].values())}, unfinished {stats['sets_unfinished']}",
        "",
        "| per dialogue | n | mean | min | median | p95 | max |",
        "|---|---|---|---|---|---|---|",
        row("images", stats["images_per_dialogue"]),
        row("turns (Q&A pairs)", stats["turns_per_dialogue"]),
        row("tokens (estimate)", stats["tokens_per_dialogue_estimate"]),
        "",
        f"clusters {c.get('count', 0)} ({c.get('backend', '?')} search), entries clustered "
        f"{c.get('entries_clustered', 0)}, left out {c.get('entries_unclustered', 0)}; size "
        f"min {c.get('size_min', 0)} mean {c.get('size_mean', 0):.1f} max {c.get('size_max', 0)}",
        "",
        "cluster size histogram: " + ", ".join(f"{k}: {v}" for k, v in c.get("histogram", {}).items()),
        "",
        "rejected sets by reason: " + (", ".join(f"{k} {v}" for k, v in stats["sets_rejected"].items()) or "none"),
        "dropped Q&A pairs by reason: " + (", ".join(f"{k} {v}" for k, v in stats["dropped_pairs"].items()) or "none"),
        "repairs: " + (", ".join(f"{k} {v}" for k, v in stats["repairs"].items()) or "none"),
        "teacher: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in stats["teacher"].items()),
    ]
    return "\n".join(lines) + "\n"


# Linked images resolve outside images/, which the image path rule refuses unless allowed.
_SYMLINK_NOTE = (
    "# output.images=symlink: the links point at the corpus's own files, outside images/.\n"
    "allow_absolute_image_paths: true\n"
)


def verify_output(cfg: BuildConfig, cache_dir: Optional[str] = None) -> str:
    """Read the merged dataset back through the MMDU reader in strict mode (images verified).

    Returns the validation report text. Raises what the reader raises on a problem.
    """
    from mmtune.data.config import SourceConfig
    from mmtune.data.readers import load_source

    out = Path(cfg.output.dir)
    source = SourceConfig(name="built", format="mmdu", path=str(out / "mmdu.json"), image_root=str(out / "images"))
    data = load_source(source, mode="strict", cache_dir=cache_dir or str(out / "cache"), check_images="verify",
                       refresh=True, allow_absolute_image_paths=cfg.output.images == "symlink")
    return data.report.render()


__all__ = ["merge", "render_stats", "estimate_tokens", "verify_output", "shard_of"]
