"""The length cache on disk, and the image stamps that invalidate its entries.

A length table (:mod:`mmtune.data.lengths`) is stored as ``lengths-<key>.npz``, ``key``
covering the records (the Arrow cache entry they were read from), the adapter's
processor / template fingerprint and every setting that changes a length. Images are not
in the key: a dynamic-resolution processor counts an image's tokens from its size, so an
image replaced under the same path (56 px grown to 448 px) changes its records' lengths.
Each record's entry therefore carries a *stamp* of its images (the hash of every image's
path, file size and modification time; the stored embedded images of a Parquet input are
named by their content already), and a table read back re-measures exactly the records
whose stamp changed, then is stored again.

With several ranks each measures its share of the chunks and writes it as a part file
beside the table; after a barrier every rank reads every part, so no rank repeats
another's work, and rank 0 stores the table for the next launch.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["StoredLengths", "image_stamps", "load_table", "save_table", "part_path", "write_failure",
           "read_failure"]


def _stamp(path: str) -> int:
    try:
        st = os.stat(path)
        ident = f"{path}\0{st.st_size}\0{st.st_mtime_ns}"
    except OSError:  # a missing image: its records are measured without it (or refused) again when it appears
        ident = f"{path}\0missing"
    return int.from_bytes(hashlib.blake2b(ident.encode(), digest_size=8).digest(), "little")


def _image_columns(dialogues: Any) -> tuple[np.ndarray, list[str]] | None:
    """``(record of each image, image paths)`` read from the Arrow cache's columns, without
    building dialogues; ``None`` when the sequence is not backed by one."""
    dataset = getattr(dialogues, "dataset", None)
    if dataset is None or "segments" not in getattr(dataset, "column_names", ()):
        return None
    records, paths, base = [], [], 0
    for chunk in dataset.data.column("segments").chunks:  # list<list<struct<text, image>>>
        turns = chunk.offsets.to_numpy()
        turns = turns - turns[0]
        segments = chunk.flatten()
        seg_offsets = segments.offsets.to_numpy()
        seg_offsets = seg_offsets - seg_offsets[0]
        record_of_turn = np.repeat(np.arange(len(chunk)), np.diff(turns))
        record_of_segment = np.repeat(record_of_turn, np.diff(seg_offsets))
        images = segments.flatten().field("image")
        valid = images.is_valid().to_numpy(zero_copy_only=False)
        records.append(record_of_segment[valid] + base)
        paths += images.drop_null().to_pylist()
        base += len(chunk)
    return (np.concatenate(records) if records else np.zeros(0, dtype=np.int64)), paths


def image_stamps(dialogues: Sequence[Any]) -> np.ndarray:
    """uint64 per record: a hash of its images' paths, sizes and modification times (0: no image)."""
    found = _image_columns(dialogues)
    if found is None:
        pairs = [(r, image.path) for r, dialogue in enumerate(dialogues) for image in dialogue.images]
        found = (np.array([r for r, _ in pairs], dtype=np.int64), [p for _, p in pairs])
    records, paths = found
    unique = {p: _stamp(p) for p in dict.fromkeys(paths)}
    hashes = np.array([unique[p] for p in paths], dtype=np.uint64)
    # Each image's hash is mixed with its place among the record's images, so swapping two changes the stamp.
    place = np.arange(len(paths), dtype=np.uint64) - np.searchsorted(records, records).astype(np.uint64)
    hashes = hashes ^ (place * np.uint64(0x9E3779B97F4A7C15))
    out = np.zeros(len(dialogues), dtype=np.uint64)
    np.bitwise_xor.at(out, records, hashes)
    return out


@dataclass
class StoredLengths:
    """Every per-record array of a length table, as stored."""

    lengths: np.ndarray
    full: np.ndarray
    images: np.ndarray
    stats: np.ndarray
    """int32 ``[n, 5]``: each record's truncation counters (:data:`mmtune.data.lengths.STAT_FIELDS`)."""
    stamps: np.ndarray
    skipped_ids: list[str]
    image_skipped: list[dict[str, Any]]

    def patch(self, indices: np.ndarray, other: "StoredLengths") -> None:
        """Replace the entries of ``indices`` by ``other``'s (measured for those records, in that order)."""
        for name in ("lengths", "full", "images", "stats", "stamps"):
            getattr(self, name)[indices] = getattr(other, name)
        gone = set(indices.tolist())
        self.image_skipped = sorted([item for item in self.image_skipped if item["index"] not in gone]
                                    + other.image_skipped, key=lambda item: item["index"])
        self.skipped_ids = (self.skipped_ids + other.skipped_ids)[:20]


def part_path(table_path: str, rank: int, world_size: int) -> str:
    return f"{table_path[:-len('.npz')]}.part{rank}of{world_size}.npz"


def write_failure(part: str, message: str | None) -> None:
    """Record why a rank's share stopped beside its part file (``None``: remove an old record)."""
    failure = part + ".failed"
    if message is None:
        if os.path.exists(failure):
            os.remove(failure)
        return
    os.makedirs(os.path.dirname(failure) or ".", exist_ok=True)
    with open(failure, "w", encoding="utf-8") as f:
        f.write(message)


def read_failure(part: str) -> str | None:
    """Why the rank of ``part`` stopped, or ``None``."""
    failure = part + ".failed"
    if not os.path.exists(failure):
        return None
    with open(failure, encoding="utf-8") as f:
        return f.read()


def save_table(path: str, stored: StoredLengths, extra: dict[str, np.ndarray] | None = None) -> None:
    """Write ``stored`` (and ``extra`` arrays) to ``path`` atomically (a temporary file renamed)."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp.npz")
    os.close(fd)
    np.savez(tmp, lengths=stored.lengths, full_lengths=stored.full, num_images=stored.images, stats=stored.stats,
             stamps=stored.stamps, skipped_ids=json.dumps(stored.skipped_ids),
             image_skipped=json.dumps(stored.image_skipped), **(extra or {}))
    os.replace(tmp, path)


def load_table(path: str) -> StoredLengths | None:
    """The stored table at ``path``; ``None`` when absent or written by an older mmtune (no stamps)."""
    if not os.path.exists(path):
        return None
    with np.load(path) as data:
        if "stamps" not in data:
            return None
        return StoredLengths(data["lengths"], data["full_lengths"], data["num_images"], data["stats"],
                             data["stamps"], json.loads(str(data["skipped_ids"])),
                             json.loads(str(data["image_skipped"])))
