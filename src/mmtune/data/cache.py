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

Reading an entry back: :class:`DialogueSequence` converts rows to dialogues lazily (one
by index, or in batches of Arrow columns when iterated).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from typing import Any, Iterator

from datasets import Dataset, Features, List, Value
from datasets.arrow_writer import ArrowWriter

from mmtune.core.dialogue import Dialogue, Image, Turn
from mmtune.io.nofollow import open_output

# Bump when the reader's output or validation rules change, so old caches are not reused.
READER_VERSION = 4  # 4: every record kept under a unique key (repeated ids trained, see mmtune.data.keys)

# Dialogue.to_record(), the record's unique key (mmtune.data.keys) and cheap per-record
# statistics used by mixing and stacking.
FEATURES = Features(
    {
        "id": Value("string"),
        "key": Value("string"),
        "source": Value("string"),
        "roles": List(Value("string")),
        "segments": List(List({"text": Value("string"), "image": Value("string")})),
        "num_images": Value("int32"),
        "num_chars": Value("int64"),
    }
)


def cache_key(path: str, options: dict[str, Any]) -> str:
    """Hex key of (file identity, reader version, options); a tabular input's identity is its
    shards' (:func:`mmtune.data.tables.input_identity`)."""
    from mmtune.data.tables import input_identity, is_table_input

    ident: dict[str, Any] = {"path": os.path.abspath(path), "reader_version": READER_VERSION, "options": options}
    if is_table_input(path):
        ident["shards"] = input_identity(path)
    else:
        st = os.stat(path)
        ident.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:20]


def entry_paths(cache_dir: str, source: str, key: str) -> tuple[str, str]:
    """``(arrow_path, report_path)`` of one cache entry."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", source)
    base = os.path.join(cache_dir, f"{safe}-{key}")
    return base + ".arrow", base + ".report.json"


class CacheWriter:
    """Streams rows into a new cache entry; :meth:`commit` makes it visible atomically.

    Rows are buffered as flat columns (every segment's text and image path in two lists, with
    the offsets of each turn's segments and each row's turns) and written a batch at a time
    as Arrow arrays built from them: no Python dict per segment, and one conversion per
    column, several times faster than row by row.
    """

    def __init__(self, arrow_path: str, report_path: str, batch_size: int = 1000):
        os.makedirs(os.path.dirname(arrow_path) or ".", exist_ok=True)
        self.arrow_path, self.report_path = arrow_path, report_path
        self._tmp = f"{arrow_path}.tmp-{os.getpid()}"
        self._writer = ArrowWriter(features=FEATURES, path=self._tmp, writer_batch_size=batch_size)
        self._batch_size = batch_size
        self._clear()

    def _clear(self) -> None:
        self._rows: dict[str, list] = {k: [] for k in ("id", "key", "source", "roles", "num_images", "num_chars")}
        self._texts: list[str | None] = []
        self._images: list[str | None] = []
        self._segment_starts = [0]  # per turn
        self._turn_starts = [0]  # per row

    def add_dialogue(self, d: Dialogue, key: str | None = None) -> None:
        """One dialogue as a row (its key: default its id), with its image and character counts."""
        texts, images, starts = self._texts, self._images, self._segment_starts
        n_img = n_chars = 0
        roles = []
        for turn in d.turns:
            roles.append(turn.role)
            for segment in turn.segments:
                if isinstance(segment, str):
                    texts.append(segment)
                    images.append(None)
                    n_chars += len(segment)
                else:
                    texts.append(None)
                    images.append(segment.path)
                    n_img += 1
            starts.append(len(texts))
        self._turn_starts.append(len(starts) - 1)
        rows = self._rows
        rows["id"].append(d.id)
        rows["key"].append(d.id if key is None else key)
        rows["source"].append(d.source)
        rows["roles"].append(roles)
        rows["num_images"].append(n_img)
        rows["num_chars"].append(n_chars)
        if len(rows["id"]) >= self._batch_size:
            self._flush()

    def add(self, row: dict[str, Any]) -> None:
        """A row in the cache's layout: :meth:`Dialogue.to_record` with its ``key`` (and counts,
        recomputed)."""
        turns = tuple(Turn(role, tuple(seg["text"] if seg["image"] is None else Image(seg["image"]) for seg in segs))
                      for role, segs in zip(row["roles"], row["segments"]))
        self.add_dialogue(Dialogue(row["id"], row["source"], turns), row["key"])

    def _flush(self) -> None:
        if not self._rows["id"]:
            return
        import pyarrow as pa

        segments = pa.StructArray.from_arrays([pa.array(self._texts, pa.string()), pa.array(self._images, pa.string())],
                                              names=["text", "image"])
        per_turn = pa.ListArray.from_arrays(pa.array(self._segment_starts, pa.int32()), segments)
        columns = {
            "id": pa.array(self._rows["id"], pa.string()),
            "key": pa.array(self._rows["key"], pa.string()),
            "source": pa.array(self._rows["source"], pa.string()),
            "roles": pa.array(self._rows["roles"], pa.list_(pa.string())),
            "segments": pa.ListArray.from_arrays(pa.array(self._turn_starts, pa.int32()), per_turn),
            "num_images": pa.array(self._rows["num_images"], pa.int32()),
            "num_chars": pa.array(self._rows["num_chars"], pa.int64()),
        }
        self._writer.write_table(pa.table({name: columns[name] for name in FEATURES}))
        self._clear()

    def add_table(self, table) -> None:
        """Rows already in the cache's layout (an Arrow table of :data:`FEATURES`), after the rows added."""
        self._flush()
        self._writer.write_table(table)

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


class DialogueSequence(Sequence):
    """Random-access, lazily converted dialogues over a memory-mapped Arrow dataset."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return self.dataset.num_rows

    @property
    def fingerprint(self) -> str:
        """The records' identity for caches built on them (the length cache): the Arrow
        entry's file name (it holds the entry's key: data file, reader version and options),
        its rows and its size. Not its time (``datasets``' own fingerprint hashes it): ranks
        that each built the same entry must agree."""
        files = [f["filename"] for f in getattr(self.dataset, "cache_files", None) or []]
        if not files:  # an in-memory dataset (tests): its own fingerprint
            return str(self.dataset._fingerprint)
        stats = [(os.path.basename(f), os.path.getsize(f)) for f in files if os.path.exists(f)]
        ident = json.dumps([stats, self.dataset.num_rows])
        return hashlib.sha256(ident.encode()).hexdigest()[:20]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"dialogue index {i} out of range for {n} dialogues")
        row = self.dataset[int(i)]
        dialogue = Dialogue.from_record(row)
        dialogue.meta["key"] = row["key"]
        return dialogue

    def read_range(self, start: int, stop: int) -> list[Dialogue]:
        """``self[start:stop]`` read as one Arrow slice, column by column (what the length
        pass reads: several times faster than row by row)."""
        return list(_dialogues_from_arrow(self.dataset.with_format("arrow")[start:stop])) if stop > start else []

    def __iter__(self) -> Iterator[Dialogue]:
        # Batched reads of 1000 rows as Arrow tables, converted column by column: the
        # nested segment structs come out as two flat lists (texts, image paths) plus
        # offsets, instead of one Python dict per segment.
        arrow = self.dataset.with_format("arrow")
        for start in range(0, len(self), 1000):
            yield from _dialogues_from_arrow(arrow[start : start + 1000])


def _offsets(array) -> list[int]:
    """A (possibly sliced) Arrow list array's offsets, relative to its own first value."""
    offsets = array.offsets.to_numpy()
    return (offsets - offsets[0]).tolist()


def _dialogues_from_arrow(table) -> Iterator[Dialogue]:
    """The dialogues of an Arrow table of cache rows (``Dialogue.to_record`` layout)."""
    ids = table.column("id").to_pylist()
    keys = table.column("key").to_pylist()
    sources = table.column("source").to_pylist()
    roles = table.column("roles").to_pylist()
    turns_of = table.column("segments").combine_chunks()  # list<list<struct<text, image>>>
    turn_starts = _offsets(turns_of)
    segments_of = turns_of.flatten()
    segment_starts = _offsets(segments_of)
    structs = segments_of.flatten()
    texts = structs.field("text").to_pylist()
    images = structs.field("image").to_pylist()
    segments = [text if image is None else Image(image) for text, image in zip(texts, images)]
    for row, dialogue_id in enumerate(ids):
        first = turn_starts[row]
        turns = tuple(
            Turn(role, tuple(segments[segment_starts[first + k]:segment_starts[first + k + 1]]))
            for k, role in enumerate(roles[row])
        )
        yield Dialogue(id=dialogue_id, source=sources[row], turns=turns, meta={"key": keys[row]})


__all__ = ["READER_VERSION", "FEATURES", "cache_key", "entry_paths", "CacheWriter", "open_entry",
           "DialogueSequence"]
