"""Arrow cache of parsed, validated sources.

A source is parsed once into an Arrow file written with ``datasets``' ``ArrowWriter``
and re-opened memory-mapped with ``Dataset.from_file``: the second load reads no JSON
and holds no copy of the data in Python memory. The cache key covers what decides the
content: the data file (absolute path, size, mtime), the reader version and every
reader option (format, image root, prefix, image check level, ...). Image files are not
part of the key: after moving or fixing images, reload with ``refresh=True``
(``mmtune data check --refresh``).

Each entry is two files, written to temporary names and renamed when complete, so an
interrupted build never leaves a half-written cache behind:
``<cache_dir>/<source>-<key>.arrow`` and ``<source>-<key>.report.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from datasets import Dataset, Features, List, Value
from datasets.arrow_writer import ArrowWriter

from mmtune.io.nofollow import open_output

# Bump when the reader's output or validation rules change, so old caches are not reused.
READER_VERSION = 3  # 3: reports number turns by question/answer exchange

# Dialogue.to_record() plus cheap per-record statistics used by mixing and stacking.
FEATURES = Features(
    {
        "id": Value("string"),
        "source": Value("string"),
        "roles": List(Value("string")),
        "segments": List(List({"text": Value("string"), "image": Value("string")})),
        "num_images": Value("int32"),
        "num_chars": Value("int64"),
    }
)


def cache_key(path: str, options: dict[str, Any]) -> str:
    """Hex key of (file identity, reader version, options)."""
    st = os.stat(path)
    ident = {
        "path": os.path.abspath(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "reader_version": READER_VERSION,
        "options": options,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:20]


def entry_paths(cache_dir: str, source: str, key: str) -> tuple[str, str]:
    """``(arrow_path, report_path)`` of one cache entry."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", source)
    base = os.path.join(cache_dir, f"{safe}-{key}")
    return base + ".arrow", base + ".report.json"


class CacheWriter:
    """Streams rows into a new cache entry; :meth:`commit` makes it visible atomically.

    Rows are buffered and written in batches because ``write_batch`` converts a whole
    column at once, which is several times faster than row by row.
    """

    def __init__(self, arrow_path: str, report_path: str, batch_size: int = 1000):
        os.makedirs(os.path.dirname(arrow_path) or ".", exist_ok=True)
        self.arrow_path, self.report_path = arrow_path, report_path
        self._tmp = f"{arrow_path}.tmp-{os.getpid()}"
        self._writer = ArrowWriter(features=FEATURES, path=self._tmp, writer_batch_size=batch_size)
        self._batch: dict[str, list] = {k: [] for k in FEATURES}
        self._batch_size = batch_size

    def add(self, row: dict[str, Any]) -> None:
        for k, col in self._batch.items():
            col.append(row[k])
        if len(self._batch["id"]) >= self._batch_size:
            self._flush()

    def _flush(self) -> None:
        if self._batch["id"]:
            self._writer.write_batch(self._batch)
            self._batch = {k: [] for k in FEATURES}

    def commit(self, report: dict[str, Any]) -> None:
        self._flush()
        self._writer.finalize()
        self._writer.close()
        tmp_report = f"{self.report_path}.tmp-{os.getpid()}"
        with open_output(tmp_report, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(self._tmp, self.arrow_path)
        os.replace(tmp_report, self.report_path)

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:  # closing a writer that failed mid-batch may raise again; the file goes anyway
            pass
        if os.path.exists(self._tmp):
            os.remove(self._tmp)


def open_entry(arrow_path: str, report_path: str) -> tuple[Dataset, dict[str, Any]] | None:
    """The cached dataset (memory-mapped) and report dict, or ``None`` if absent."""
    if not (os.path.isfile(arrow_path) and os.path.isfile(report_path)):
        return None
    with open(report_path) as f:
        report = json.load(f)
    return Dataset.from_file(arrow_path), report


__all__ = ["READER_VERSION", "FEATURES", "cache_key", "entry_paths", "CacheWriter", "open_entry"]
