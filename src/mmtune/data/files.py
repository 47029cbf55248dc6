"""Data files named on a command line or in ``data.files``: one source each, its format detected.

A data file is a JSON list or JSONL file, or a tabular input (:mod:`mmtune.data.tables`): a
Parquet file, a folder of shards, a ``datasets.save_to_disk`` folder or a glob of shards.

``mmtune data check FILE...``, ``data.files=[...]`` of a training run and the held-out
benchmarks read files the same way through :func:`sources_from_files`.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from mmtune.data.config import ConfigError, SourceConfig
from mmtune.data.formats import detect_format
from mmtune.data.tables import input_files, is_table_input

__all__ = ["DATA_SUFFIXES", "sources_from_files"]

DATA_SUFFIXES = (".json", ".jsonl")


def _stem(path: str) -> str:
    """A source's name from its input: the file's stem, a folder's name, or the glob's folder
    (``hub/llava/data/train-*.parquet`` -> ``data``)."""
    if is_table_input(path) and not os.path.isfile(path):
        path = path.split("*", 1)[0].rstrip("/") if not os.path.isdir(path) else path.rstrip("/")
        path = path if os.path.isdir(path) else os.path.dirname(path)
        return os.path.basename(os.path.abspath(path)) or "data"
    return os.path.splitext(os.path.basename(path))[0] or "data"


def sources_from_files(files: Sequence[str], image_root: Optional[str] = None, *, key: str = "data.files",
                       fmt: Optional[str] = None, max_record_bytes: Optional[int] = None,
                       ) -> tuple[list[SourceConfig], list[str]]:
    """One source per data file, its format detected (:func:`~mmtune.data.formats.detect_format`), named after
    the file (``chats/a.json`` -> ``a``; ``a_2`` ... when two files share a name).

    Args:
        image_root: every source's image root (``None``: each file's folder).
        key: the config key (or command-line argument) the files came from, named in problems.
        fmt: the format of every file, when given (``--format``); ``None``: detected.
        max_record_bytes: no record is read past it while detecting (``data.validation.max_record_bytes``).

    Returns:
        The sources, and per source the reason for its format (``detected: ...``).

    Raises:
        ConfigError: listing every file that is missing, not JSON/JSONL or of no known format.
        DataValidationError: a JSON list broken in its own structure (line and column).
    """
    sources, reasons, problems, names = [], [], [], set()
    for i, path in enumerate(files):
        where = f"{key}[{i}]={path!r}"
        tabular = is_table_input(path)
        if not (os.path.isfile(path) or (tabular and input_files(path))):
            what = "matches no Parquet / Arrow / JSONL shard" if tabular else "does not exist"
            problems.append(f"{where} {what} (relative paths start at the folder you run in, {os.getcwd()})")
            continue
        if not (tabular or path.lower().endswith(DATA_SUFFIXES)):
            problems.append(f"{where} is not a .json, .jsonl or .parquet file, a folder of shards or a glob")
            continue
        if fmt:
            found, why = fmt, "given with --format"
        else:
            from mmtune.data.validation import DataValidationError

            try:
                found, why = detect_format(path, max_record_bytes=max_record_bytes)
            except DataValidationError:  # the file's own structure is broken: that is the message
                raise
            except ValueError as err:
                problems.append(f"{where}: {err}")
                continue
            why = f"detected: {why}"
        stem = _stem(path)
        name, n = stem, 1
        while name in names:
            n += 1
            name = f"{stem}_{n}"
        names.add(name)
        sources.append(SourceConfig(name=name, format=found, path=path, image_root=image_root))
        reasons.append(why)
    if problems:
        raise ConfigError("data files that cannot be read:\n  - " + "\n  - ".join(problems))
    return sources, reasons
