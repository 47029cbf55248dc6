"""Image sets inside clusters, matched by caption similarity (paper §2.2).

Within one cluster, a set starts at the first unused image and grows with the unused
images whose captions are closest to the seed's, up to a size drawn in
``[min_images, max_images]``, taking at most ``max_images_per_entry`` images of one
entry so a set spans entries. Each image is used in at most one set. The draw is
seeded per cluster, so a plan is reproducible and identical on every shard.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from mmtune.data.build.config import SetsConfig
from mmtune.data.build.corpus import CorpusEntry


@dataclass(frozen=True)
class SetImage:
    """One image of a set with what the teacher is told about it."""

    entry_id: str
    path: str
    caption: str
    tags: tuple[str, ...]
    text: str


@dataclass(frozen=True)
class ImageSet:
    """Images a dialogue is generated from. ``id`` is a hash of the image paths (stable key)."""

    id: str
    cluster: int
    images: tuple[SetImage, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "cluster": self.cluster, "images": [asdict(i) for i in self.images]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ImageSet":
        images = tuple(SetImage(i["entry_id"], i["path"], i["caption"], tuple(i["tags"]), i["text"]) for i in d["images"])
        return cls(d["id"], int(d["cluster"]), images)


def set_id(paths: Sequence[str]) -> str:
    return hashlib.sha1(json.dumps(list(paths)).encode("utf-8")).hexdigest()[:16]


def form_sets(
    entries: Sequence[CorpusEntry],
    clusters: Sequence[Sequence[int]],
    caption_emb: np.ndarray,
    image_offsets: np.ndarray,
    cfg: SetsConfig,
) -> list[ImageSet]:
    """Image sets of every cluster, in cluster order.

    Args:
        entries: the corpus entries clusters index into.
        clusters: lists of entry indices.
        caption_emb: unit embedding of every image's caption, entries' images in order.
        image_offsets: ``image_offsets[e]`` is the row of entry ``e``'s first image in ``caption_emb``.
        cfg: set sizes and matching rules.
    """
    sets: list[ImageSet] = []
    for c, members in enumerate(clusters):
        rng = random.Random(f"{cfg.seed}:{c}")
        pool = [(e, k) for e in members for k in range(len(entries[e].images))]
        rows = np.array([image_offsets[e] + k for e, k in pool], dtype=np.int64)
        used = np.zeros(len(pool), dtype=bool)
        sims = caption_emb[rows] @ caption_emb[rows].T if len(pool) else np.zeros((0, 0), np.float32)
        for seed in range(len(pool)):
            if used[seed]:
                continue
            if (~used).sum() < cfg.min_images:
                break
            target = rng.randint(cfg.min_images, cfg.max_images)
            chosen, per_entry = [seed], {pool[seed][0]: 1}
            for j in np.argsort(-sims[seed], kind="stable"):
                if len(chosen) >= target:
                    break
                j = int(j)
                if used[j] or j == seed or sims[seed, j] < cfg.caption_threshold:
                    continue
                e = pool[j][0]
                if per_entry.get(e, 0) >= cfg.max_images_per_entry:
                    continue
                chosen.append(j)
                per_entry[e] = per_entry.get(e, 0) + 1
            used[seed] = True  # a seed that cannot start a set is not retried
            if len(chosen) < cfg.min_images:
                continue
            used[chosen] = True
            images = tuple(
                SetImage(
                    entries[pool[j][0]].id,
                    entries[pool[j][0]].images[pool[j][1]],
                    entries[pool[j][0]].captions[pool[j][1]],
                    entries[pool[j][0]].tags,
                    entries[pool[j][0]].text,
                )
                for j in chosen
            )
            sets.append(ImageSet(set_id([i.path for i in images]), c, images))
            if cfg.max_sets is not None and len(sets) >= cfg.max_sets:
                return sets
    return sets


__all__ = ["SetImage", "ImageSet", "form_sets", "set_id"]
