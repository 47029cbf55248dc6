"""Tabular inputs: Parquet files, folders and globs of shards, ``datasets.save_to_disk``
folders and globs of JSON / JSONL shards, as a source's ``path``.

The data sets users download today ship as Parquet shards (the hub's
``data/train-00000-of-00042.parquet`` layout), often with their images embedded as bytes
(the Hugging Face ``Image`` feature: ``{"bytes": ..., "path": ...}``), or as folders written
by ``datasets.Dataset.save_to_disk``. Each is read here as one source, shard by shard and
batch by batch with pyarrow (``datasets`` wrote and memory-maps the save_to_disk shards), so
no shard is held in memory whole; every row is a record for the source's format plugin,
its columns named as that format's fields (llava ``id`` / ``image`` / ``conversations``,
MMDU's ``image`` list, the ``messages`` format's ``messages``).

An embedded image is never decoded here: its bytes are written once to
``<images_dir>/<sha256 of the bytes><ext>`` (:class:`EmbeddedImages`), and the record names
that file. So every cache that keys on an image's path (the Arrow cache, the length cache,
the pixel cache) keys on the image's content, and an image changed in a new download is a
new file. Only the header is read (PIL's lazy open), so bytes that are no image are named
where they are, ``(file, row, column)``, as a ``corrupt_image`` problem of that record. A
shard that cannot be opened is an ``unreadable_shard`` problem counted as one skipped
record; both follow ``validation.mode`` as every other problem does.

Example::

    files = input_files("hub/llava-mix/data/train-*.parquet")   # the shards, sorted
    for index, record, problem in iter_table_records(path, EmbeddedImages(cache + "/images"), 1 << 28):
        ...
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import re
from typing import Any, Callable, Iterator

from mmtune.data.validation import Problem

__all__ = ["TABLE_SUFFIXES", "EmbeddedImages", "is_table_input", "input_files", "default_image_root",
           "input_identity", "iter_table_records"]

TABLE_SUFFIXES = (".parquet",)
_FOLDER_SUFFIXES = (".parquet", ".arrow", ".jsonl")  # the shards of a folder (its .json files may be metadata)
_ROWS_PER_BATCH = 256  # rows converted to Python at a time: bounded memory for image-heavy shards


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _is_saved_dataset(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "state.json")) and os.path.isfile(
        os.path.join(folder, "dataset_info.json"))


def is_table_input(path: str) -> bool:
    """A Parquet file, a folder of shards, a ``save_to_disk`` folder or a glob (not a single JSON / JSONL file)."""
    return path.lower().endswith(TABLE_SUFFIXES) or os.path.isdir(path) or _is_glob(path)


def input_files(path: str) -> list[str]:
    """The shard files of an input, in their order: a glob's matches, a ``save_to_disk``
    folder's Arrow files (its ``state.json`` order), a folder's Parquet / Arrow / JSONL files
    (recursively, sorted), or the file itself. ``[]`` when nothing matches."""
    if _is_glob(path):
        return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
                state = json.load(f)
            return [os.path.join(path, entry["filename"]) for entry in state.get("_data_files", [])]
        found = glob.glob(os.path.join(path, "**", "*"), recursive=True)
        return sorted(p for p in found if os.path.isfile(p) and p.lower().endswith(_FOLDER_SUFFIXES))
    return [path] if os.path.isfile(path) else []


def default_image_root(path: str) -> str:
    """Where image paths of an input are relative to by default: a folder itself, else the
    folder of the file (or of the glob's pattern)."""
    if os.path.isdir(path):
        return os.path.abspath(path)
    return os.path.dirname(os.path.abspath(path.split("*", 1)[0] if _is_glob(path) else path)) or os.getcwd()


def input_identity(path: str) -> list[list[Any]]:
    """``[[file, size, mtime_ns], ...]`` of every shard: what the Arrow cache keys a tabular input on."""
    return [[os.path.abspath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in input_files(path)]


_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


class EmbeddedImages:
    """Writes embedded image bytes once, named by their SHA-256, under ``folder``.

    ``store`` reads only the image header (no pixel is decoded) to name the file's
    extension and to refuse bytes that are no image."""

    def __init__(self, folder: str, write: bool = True):
        self.folder, self.write = folder, write

    def store(self, data: bytes) -> str:
        """The file holding ``data``. Raises ``ValueError`` when the bytes are no image."""
        from PIL import Image as PILImage

        try:
            with PILImage.open(io.BytesIO(data)) as im:
                ext = "." + (im.format or "img").lower()
        except Exception as err:  # PIL raises many types for bytes that are no image
            # without the reprs of PIL's in-memory file (an address, different at every read)
            raise ValueError(f"{type(err).__name__}: {_OBJECT_REPR.sub('the bytes', str(err))}") from None
        name = os.path.join(self.folder, hashlib.sha256(data).hexdigest() + ext)
        if self.write and not os.path.exists(name):
            os.makedirs(self.folder, exist_ok=True)
            tmp = f"{name}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, name)
        return name


def _is_image_struct(value: Any) -> bool:
    return isinstance(value, dict) and "bytes" in value and set(value) <= {"bytes", "path"}


def _unpack_images(row: dict, images: EmbeddedImages) -> tuple[str, str] | None:
    """Replace every ``{"bytes", "path"}`` value of ``row`` (a column, or an element of a list
    column) by a path: the stored bytes' file, or the path when there are no bytes.
    Returns ``(column, detail)`` of the first bytes that are no image, else ``None``."""
    for column, value in row.items():
        many = isinstance(value, list)
        items = value if many else [value]
        if not any(_is_image_struct(v) for v in items):
            continue
        paths = []
        for k, item in enumerate(items):
            if not _is_image_struct(item) or item.get("bytes") is None:
                paths.append(item.get("path") if _is_image_struct(item) else item)
                continue
            try:
                paths.append(images.store(item["bytes"]))
            except ValueError as err:
                return (f"{column}[{k}]" if many else column), str(err)
        row[column] = paths if many else paths[0]
    return None


def _record_id(row: Any, index: int) -> str:
    rid = row.get("id") if isinstance(row, dict) else None
    return str(rid) if rid is not None else f"#{index}"


def _arrow_batches(shard: str) -> Iterator[Any]:
    """Record batches of one Parquet or Arrow shard."""
    if shard.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(shard).iter_batches(batch_size=_ROWS_PER_BATCH)
        return
    from datasets import Dataset

    table = Dataset.from_file(shard).data  # memory-mapped, as datasets wrote it
    yield from table.to_batches(max_chunksize=_ROWS_PER_BATCH)


def _batch_rows(batch: Any, first: int, wanted: Callable[[int], bool] | None) -> list:
    """A batch's rows as Python dicts, ``None`` for the rows (at ``first + k``) ``wanted`` refuses."""
    if wanted is None:
        return batch.to_pylist()
    keep = [wanted(first + k) for k in range(batch.num_rows)]
    if all(keep):
        return batch.to_pylist()
    if not any(keep):
        return [None] * batch.num_rows
    rows = iter(batch.filter(keep).to_pylist())
    return [next(rows) if kept else None for kept in keep]


def _shard_rows(shard: str, max_record_bytes: int, first: int = 0,
                wanted: Callable[[int], bool] | None = None) -> Iterator[tuple[Any, Problem | None]]:
    """``(row, problem)`` of one shard, whose first row is record ``first`` of the input; a shard
    that cannot be opened is one problem row; rows ``wanted`` refuses are ``None`` (not converted)."""
    local = None if wanted is None else (lambda k: wanted(first + k))
    if shard.lower().endswith((".json", ".jsonl")):
        from mmtune.data.records import iter_records

        for _, obj, problem in iter_records(shard, max_record_bytes, local):
            yield obj, problem
        return
    try:
        done = 0
        for batch in _arrow_batches(shard):
            rows = _batch_rows(batch, done, local)
            done += batch.num_rows
            yield from ((row, None) for row in rows)
    except Exception as err:  # pyarrow / datasets raise many types for a broken shard
        yield None, Problem("unreadable_shard", os.path.basename(shard), 0, None,
                            f"{shard}: {type(err).__name__}: {err}")


def iter_table_records(path: str, images: EmbeddedImages, max_record_bytes: int,
                       wanted: Callable[[int], bool] | None = None) -> Iterator[tuple[int, Any, Problem | None]]:
    """``(index, record, problem)`` of every row of a tabular input (:func:`is_table_input`),
    shard by shard, its embedded images stored by ``images``; a problem names the shard and
    the row in it (and the column of bytes that are no image). ``wanted``: only the rows it
    accepts are converted and their images stored (another process reads the others: they
    are yielded as ``None``)."""
    index = 0
    for shard in input_files(path):
        for row_in_shard, (row, problem) in enumerate(_shard_rows(shard, max_record_bytes, index, wanted)):
            if problem is not None:
                problem = Problem(problem.code, problem.record_id, index, problem.turn_index,
                                  problem.detail if problem.code == "unreadable_shard"
                                  else f"{shard} row {row_in_shard}: {problem.detail}")
            elif isinstance(row, dict) and (wanted is None or wanted(index)):
                bad = _unpack_images(row, images)
                if bad is not None:
                    problem = Problem("corrupt_image", _record_id(row, index), index, None,
                                      f"{shard} row {row_in_shard} column {bad[0]}: embedded bytes are no image "
                                      f"({bad[1]})")
            yield index, row, problem
            index += 1
