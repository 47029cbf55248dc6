"""The identity of each data source's file, recorded with checkpoints and compared on resume.

A resume compares its config with the one the checkpoint was saved with
(:func:`mmtune.training.checkpoint.check_resume_config`), but the config names files, not
their contents: a training file overwritten with another data set under the same path
(even of the same size) would be continued silently, its batch plan and sample order
now those of other records. So the config record a checkpoint keeps gets one more key per
source, ``data.mixture.sources[<i>].content``: the SHA-256 of the file's bytes and its
size. A changed file then shows up in a resume like any changed setting: refused with the
list of changes, allowed only with ``training.resume_config_changes`` (that key, or a
parent such as ``data``), and then recorded with the step it takes effect from.

Why a content hash and not size and modification time (what the Arrow cache keys on,
:mod:`mmtune.data.cache`): the same size is exactly the case to catch, and a copy of the
run to another machine, or a ``touch``, changes the time but not the data, which must not
refuse a resume. The cost: each file is read and hashed once per start of a run, by the
main process on one core (SHA-256's speed on that core, or the disk's, whichever is lower);
images are not covered, as the cache does not cover them either.
"""

from __future__ import annotations

import copy
import hashlib
import os
from typing import Any, Optional, Sequence

__all__ = ["CONTENT_KEY", "MISSING", "file_identity", "source_identities", "content_keys", "with_identities",
           "comparable_record"]

CONTENT_KEY = "content"
"""The key added to each source of the config record: ``data.mixture.sources[<i>].content``."""

MISSING = "missing"
"""The identity of a source whose file does not exist."""


def file_identity(path: str | os.PathLike) -> str:
    """``"sha256:<hex>, <n> bytes"`` of a file's content, or :data:`MISSING`. A tabular input
    (a folder or glob of shards, :mod:`mmtune.data.tables`) hashes its shards' names and
    bytes in order."""
    from mmtune.data.tables import input_files, is_table_input

    digest = hashlib.sha256()
    size = 0
    shards = input_files(str(path)) if is_table_input(str(path)) and not os.path.isfile(path) else [path]
    if not shards:
        return MISSING
    try:
        for shard in shards:
            if len(shards) > 1:
                digest.update(os.path.basename(shard).encode() + b"\0")
            with open(shard, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(block)
                    size += len(block)
    except FileNotFoundError:
        return MISSING
    return f"sha256:{digest.hexdigest()}, {size} bytes"


def source_identities(sources: Sequence[Any]) -> list[str]:
    """The identity of every source's file (``SourceConfig.path``), in the sources' order."""
    return [file_identity(source.path) for source in sources]


def content_keys(sources: Sequence[Any]) -> list[str]:
    """The dotted keys the identities take in a config record (for ``training.resume_config_changes``)."""
    return [f"data.mixture.sources[{i}].{CONTENT_KEY}" for i in range(len(sources))]


def with_identities(record: dict[str, Any], identities: Optional[Sequence[str]]) -> dict[str, Any]:
    """A copy of a run's config record with each source's identity under ``content``."""
    if identities is None:
        return record
    record = copy.deepcopy(record)
    sources = record.get("data", {}).get("mixture", {}).get("sources", [])
    for source, identity in zip(sources, identities):
        source[CONTENT_KEY] = identity
    return record


def comparable_record(saved: dict[str, Any], current: dict[str, Any]) -> tuple[dict[str, Any], Optional[str]]:
    """``current`` as it can be compared with the record ``saved`` by a checkpoint, and a note.

    A checkpoint saved before identities were recorded has none: the comparison then leaves
    them out (rather than refusing every such resume), and the note says the data could
    not be checked.
    """
    saved_sources = saved.get("data", {}).get("mixture", {}).get("sources", [])
    if any(CONTENT_KEY in source for source in saved_sources if isinstance(source, dict)):
        return current, None
    current = copy.deepcopy(current)
    for source in current.get("data", {}).get("mixture", {}).get("sources", []):
        source.pop(CONTENT_KEY, None)
    return current, ("note: the checkpoint does not record its data files' content (saved by an older mmtune), so "
                     "a change of the files under the same paths cannot be checked")
