"""The build stages: plan (corpus -> clusters -> image sets), generate (teacher), merge.

Output folder layout::

    <output.dir>/plan/plan.json          settings fingerprint, corpus report, cluster stats
    <output.dir>/plan/sets.jsonl         every image set, in a fixed order
    <output.dir>/shards/<i>-of-<n>/      dialogues.jsonl, rejected.jsonl, teacher_cache.sqlite
    <output.dir>/mmdu.json, images/, data.yaml, stats.json, stats.md, tokens_per_dialogue.png

Restarts: a shard appends each finished set to ``dialogues.jsonl`` (or, when its
replies could not make a valid dialogue, to ``rejected.jsonl``) as soon as it is done,
and every teacher reply is in the SQLite cache the moment it arrives. A killed run
skips finished sets and answers the calls of unfinished ones from the cache, so no
paid call is repeated. Sets whose calls failed after all retries are not recorded and
are tried again next run.

Sharding: set ``s`` belongs to shard ``int(s.id, 16) % n``. Every shard computes the
same plan (deterministic) or reuses the one already in the output folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import numpy as np

from mmtune.data.build.assemble import build_record, validate_record
from mmtune.data.build.clustering import cluster_embeddings, size_histogram
from mmtune.data.build.config import BuildConfig
from mmtune.data.build.corpus import read_corpus
from mmtune.data.build.embedding import Embedder, build_embedder
from mmtune.data.build.parsing import QA, parse_reply, renumber
from mmtune.data.build.sets import ImageSet, form_sets
from mmtune.data.build.teacher import Prompts, request, teacher_client
from mmtune.data.validation import ImageChecker
from mmtune.io.nofollow import open_output, write_output_text

log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """A build cannot go on (mismatched plan, bad shard spec, no teacher model...)."""


# --------------------------------------------------------------------------- plan


def plan_fingerprint(cfg: BuildConfig) -> str:
    """Hash of everything that changes the plan: corpus file identity and grouping settings."""
    st = os.stat(cfg.corpus.path)
    payload = {
        "corpus": [os.path.abspath(cfg.corpus.path), st.st_size, int(st.st_mtime), asdict(cfg.corpus)],
        "embed": asdict(cfg.embed), "cluster": asdict(cfg.cluster), "sets": asdict(cfg.sets),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Plan:
    sets: list[ImageSet]
    info: dict[str, Any] = field(default_factory=dict)


def make_plan(cfg: BuildConfig, embedder: Optional[Embedder] = None) -> Plan:
    """Read the corpus, embed, cluster and form image sets (no files written)."""
    timings: dict[str, float] = {}
    t = time.perf_counter()
    entries, report = read_corpus(
        cfg.corpus.path, image_root=cfg.corpus.image_root, check_images=cfg.corpus.check_images, limit=cfg.corpus.limit
    )
    timings["read_s"] = time.perf_counter() - t
    embedder = embedder or build_embedder(cfg.embed)
    t = time.perf_counter()
    emb = embedder.encode([e.embedding_text() for e in entries])
    timings["embed_entries_s"] = time.perf_counter() - t
    t = time.perf_counter()
    clusters, backend = cluster_embeddings(emb, cfg.cluster)
    timings["cluster_s"] = time.perf_counter() - t
    t = time.perf_counter()
    clustered = sorted({e for c in clusters for e in c})
    offsets = np.zeros(len(entries), dtype=np.int64)
    captions: list[str] = []
    for e in clustered:
        offsets[e] = len(captions)
        # An image without a caption is matched by its entry's tags.
        captions += [c or entries[e].embedding_text() for c in entries[e].captions]
    caption_emb = embedder.encode(captions) if captions else np.zeros((0, 1), np.float32)
    sets = form_sets(entries, clusters, caption_emb, offsets, cfg.sets)
    timings["sets_s"] = time.perf_counter() - t
    sizes = [len(c) for c in clusters]
    info = {
        "corpus": report.to_dict(),
        "clusters": {
            "backend": backend, "count": len(clusters), "entries_clustered": len(clustered),
            "entries_unclustered": len(entries) - len(clustered),
            "size_min": min(sizes, default=0), "size_max": max(sizes, default=0),
            "size_mean": float(np.mean(sizes)) if sizes else 0.0, "histogram": size_histogram(clusters),
        },
        "sets": {"count": len(sets), "images": sum(len(s.images) for s in sets)},
        "timings": timings,
    }
    return Plan(sets, info)


def load_or_make_plan(cfg: BuildConfig, embedder: Optional[Embedder] = None) -> Plan:
    """The plan in ``<output.dir>/plan`` if its fingerprint matches, else a new one, saved.

    Raises:
        BuildError: the folder holds a plan made with other settings or another corpus.
    """
    plan_dir = Path(cfg.output.dir) / "plan"
    fp = plan_fingerprint(cfg)
    info_path, sets_path = plan_dir / "plan.json", plan_dir / "sets.jsonl"
    if info_path.is_file() and sets_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("fingerprint") != fp:
            raise BuildError(
                f"{plan_dir} holds a plan made from another corpus or other embed/cluster/sets settings "
                f"(fingerprint {info.get('fingerprint')} != {fp}); its shards would not match. "
                "Use a new output.dir, or delete the folder to rebuild from scratch."
            )
        sets = [ImageSet.from_dict(json.loads(line)) for line in sets_path.read_text().splitlines() if line.strip()]
        return Plan(sets, info)
    plan = make_plan(cfg, embedder)
    plan.info["fingerprint"] = fp
    plan_dir.mkdir(parents=True, exist_ok=True)
    # Written to temporary names and renamed: shards that plan at the same time write
    # identical content, and a reader never sees half a file.
    tmp = f".tmp-{os.getpid()}"
    write_output_text(plan_dir / f"sets.jsonl{tmp}", "".join(json.dumps(s.to_dict()) + "\n" for s in plan.sets))
    os.replace(plan_dir / f"sets.jsonl{tmp}", sets_path)
    write_output_text(plan_dir / f"plan.json{tmp}", json.dumps(plan.info, indent=1))
    os.replace(plan_dir / f"plan.json{tmp}", info_path)
    return plan


# --------------------------------------------------------------------------- generate


def parse_shard(spec: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with 0 <= i < n.

    Raises:
        BuildError: not of that form.
    """
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise BuildError(f"--shard {spec!r}: expected i/n, e.g. 0/4 (shards are numbered from 0)") from None
    if n < 1 or not 0 <= i < n:
        raise BuildError(f"--shard {spec!r}: need 0 <= i < n")
    return i, n


def shard_of(set_id: str, n: int) -> int:
    return int(set_id, 16) % n


def shard_dir(cfg: BuildConfig, i: int, n: int) -> Path:
    return Path(cfg.output.dir) / "shards" / f"{i}-of-{n}"


def read_jsonl_tolerant(path: Path) -> list[dict]:
    """Records of a checkpoint file; a last line cut off by a kill is dropped (and removed)."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    out, good = [], []
    for line in lines:
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
            good.append(line)
        except json.JSONDecodeError:
            log.warning("%s: dropping a partly written line (the run was interrupted)", path)
    if len(good) != sum(1 for line in lines if line.strip()):
        write_output_text(path, "".join(g + "\n" for g in good))
    return out


@dataclass
class SetOutcome:
    set_id: str
    status: str
    """``ok``, ``rejected`` (replies cannot make a valid dialogue) or ``failed`` (calls failed)."""
    record: Optional[dict] = None
    reason: str = ""
    repairs: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)


class SetGenerator:
    """Makes one dialogue from one image set: summaries, per-image Q&A, cross-image Q&A."""

    def __init__(self, cfg: BuildConfig, client, prompts: Prompts):
        self.cfg, self.client, self.prompts = cfg, client, prompts
        self.checker = ImageChecker("exists")
        # An entry's images can land in several sets in flight at once: one summary call per
        # entry, the other sets wait for it (the reply cache alone would not stop the race).
        self._summary_locks: dict[str, threading.Lock] = {}
        self._summaries: dict[str, str] = {}
        self._lock = threading.Lock()

    def _summary(self, image) -> Optional[str]:
        with self._lock:
            lock = self._summary_locks.setdefault(image.entry_id, threading.Lock())
        with lock:
            if image.entry_id not in self._summaries:
                reply = self._ask(self.prompts.summarize(image.text, image.tags), [])
                if reply is None:
                    return None
                self._summaries[image.entry_id] = reply.strip()
            return self._summaries[image.entry_id]

    def _ask(self, prompt: str, images) -> Optional[str]:
        reply = self.client.judge(request(prompt, images, self.cfg.teacher))
        return reply.content if reply.ok else None

    def __call__(self, s: ImageSet) -> SetOutcome:
        try:
            return self._generate(s)
        except OSError as e:  # an image moved or unreadable since the plan: this set only
            log.warning("image set %s: %s", s.id, e)
            return SetOutcome(s.id, "failed", reason="image_unreadable")

    def _generate(self, s: ImageSet) -> SetOutcome:
        out = SetOutcome(s.id, "ok")
        texts: dict[str, str] = {}
        limit = self.cfg.prompts.summarize_chars
        for image in s.images:
            if image.entry_id in texts:
                continue
            text = image.text
            if limit and len(text) > limit:
                text = self._summary(image)
                if text is None:
                    return SetOutcome(s.id, "failed", reason="teacher_failed")
            texts[image.entry_id] = text
        per_image: list[list[QA]] = []
        if self.cfg.prompts.per_image_pairs > 0:
            for k, image in enumerate(s.images, 1):
                reply = self._ask(self.prompts.per_image(image, texts[image.entry_id]), [image.path])
                if reply is None:
                    return SetOutcome(s.id, "failed", reason="teacher_failed")
                parsed = parse_reply(reply, 1)
                out.repairs.update(parsed.repairs)
                out.dropped.update(parsed.dropped)
                if parsed.error:
                    out.dropped[f"per_image_{parsed.error}"] += 1
                per_image.append([renumber(p, k) for p in parsed.pairs])
        else:
            per_image = [[] for _ in s.images]
        cross: list[QA] = []
        if self.cfg.prompts.cross_image_pairs > 0 and len(s.images) > 1:
            reply = self._ask(self.prompts.cross_image(s.images, texts), [i.path for i in s.images])
            if reply is None:
                return SetOutcome(s.id, "failed", reason="teacher_failed")
            parsed = parse_reply(reply, len(s.images))
            out.repairs.update(parsed.repairs)
            out.dropped.update(parsed.dropped)
            if parsed.error:
                out.dropped[f"cross_image_{parsed.error}"] += 1
            cross = parsed.pairs
            if not cross:
                out.status, out.reason = "rejected", "no_cross_image_pairs"
                return out
        if not cross and not any(per_image):
            out.status, out.reason = "rejected", "no_pairs"
            return out
        record = build_record(s, per_image, cross)
        problems = validate_record(record, self.checker)
        if problems:
            out.status, out.reason = "rejected", f"invalid_{problems[0].code}"
            return out
        out.record = record
        return out


def _bounded_map(fn, items: Iterable, workers: int) -> Iterator:
    """``fn`` over ``items`` on ``workers`` threads, at most 2*workers submitted (streaming)."""
    it = iter(items)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending = set()
        for item in it:
            pending.add(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                yield from (f.result() for f in done)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            yield from (f.result() for f in done)


def generate_shard(
    cfg: BuildConfig, plan: Plan, shard: tuple[int, int] = (0, 1), *, env: Optional[dict[str, str]] = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Generate the dialogues of one shard's sets, resuming from its checkpoint; returns its stats."""
    from mmtune.evaluation.judge.client import JudgeError

    i, n = shard
    folder = shard_dir(cfg, i, n)
    folder.mkdir(parents=True, exist_ok=True)
    done_path, rejected_path = folder / "dialogues.jsonl", folder / "rejected.jsonl"
    done = {r["id"] for r in read_jsonl_tolerant(done_path)} | {r["id"] for r in read_jsonl_tolerant(rejected_path)}
    mine = [s for s in plan.sets if shard_of(s.id, n) == i]
    todo = [s for s in mine if s.id not in done]
    try:
        client = teacher_client(cfg.teacher, folder / "teacher_cache.sqlite", env=env)
    except JudgeError:
        raise BuildError(
            f"no teacher model: set teacher.model in the build config or the environment variable "
            f"{cfg.teacher.model_env}"
        ) from None
    generator = SetGenerator(cfg, client, Prompts(cfg.prompts))
    counts: Counter = Counter()
    repairs: Counter = Counter()
    dropped: Counter = Counter()
    t = time.perf_counter()
    from tqdm.auto import tqdm

    try:
        with open_output(done_path, "a") as ok_f, open_output(rejected_path, "a") as bad_f, tqdm(
            total=len(todo), desc=f"shard {i}/{n}", disable=not progress
        ) as bar:
            for outcome in _bounded_map(generator, todo, cfg.teacher.concurrency):
                counts[outcome.status] += 1
                repairs.update(outcome.repairs)
                dropped.update(outcome.dropped)
                if outcome.status == "ok":
                    ok_f.write(json.dumps(outcome.record) + "\n")
                    ok_f.flush()
                elif outcome.status == "rejected":
                    counts[f"rejected:{outcome.reason}"] += 1
                    bad_f.write(json.dumps({"id": outcome.set_id, "reason": outcome.reason}) + "\n")
                    bad_f.flush()
                else:
                    counts[f"failed:{outcome.reason}"] += 1
                bar.update(1)
    finally:
        client.close()
    stats = {
        "shard": [i, n], "sets_in_shard": len(mine), "already_done": len(mine) - len(todo),
        "outcomes": dict(counts), "repairs": dict(repairs), "dropped_pairs": dict(dropped),
        "teacher": client.stats.to_dict(), "wall_s": time.perf_counter() - t,
    }
    # Each run of a shard adds its counts; the merge sums them, so a resumed build still
    # reports every call it paid for.
    path = folder / "stats.json"
    runs = json.loads(path.read_text()).get("runs", []) if path.is_file() else []
    write_output_text(path, json.dumps({"runs": runs + [stats]}, indent=1))
    return stats


__all__ = [
    "BuildError", "Plan", "SetGenerator", "SetOutcome", "make_plan", "load_or_make_plan", "plan_fingerprint",
    "generate_shard", "parse_shard", "shard_of", "shard_dir", "read_jsonl_tolerant",
]
