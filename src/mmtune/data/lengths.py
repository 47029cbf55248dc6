"""Exact post-expansion length of every sample, computed once and cached.

Batching, packing and truncation need each sample's real length: text tokens of the
rendered template plus every image's token count. The length pass renders and tokenizes
text (batched: one tokenizer call per few hundred dialogues) and asks the adapter for
image token counts, which never decodes pixels (fixed for LLaVA-1.5; header-only for
dynamic-resolution processors). Truncation is applied exactly as the dataset will apply
it, so the lengths are those of the samples training will see (0 = skipped).

The table is cached as ``<cache_dir>/lengths-<key>.npz``, ``key`` hashing the dataset
fingerprint, the adapter's fingerprint and every setting that changes a length
(max_length, truncation, train_on, system_prompt).

Example::

    table = compute_lengths(adapter, dialogues, max_length=8192, cache_dir="cache/lengths")
    plan = build_plan(order, table.lengths, collator_cfg, num_images=table.num_images)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import multiprocessing
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from mmtune.data.encoding import encode_dialogues, truncate_dialogue
from mmtune.data.length_store import (StoredLengths, image_stamps, load_table, part_path, read_failure, save_table,
                                      write_failure)
from mmtune.data.images import CorruptImageError
from mmtune.data.truncation import TruncationStats, fit_turns
from mmtune.core.encoded import ImageChunk

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.dialogue import Dialogue
    from mmtune.models.base import ModelAdapter

__all__ = ["LengthTable", "compute_lengths", "dataset_fingerprint", "adapter_fingerprint", "table_location",
           "measure_records", "STAT_FIELDS"]


@dataclass
class LengthTable:
    """Per-sample lengths (index = position in the dialogue sequence)."""

    lengths: np.ndarray
    """int32 length after truncation; 0 when the sample is skipped."""
    full_lengths: np.ndarray
    """int32 length before truncation."""
    num_images: np.ndarray
    """int32 images kept after truncation."""
    key: str
    """Cache key the table was computed (or loaded) under."""
    stats: dict[str, int] = field(default_factory=dict)
    """Truncation counters (samples, truncated, skipped, dropped_turns, dropped_images)."""
    from_cache: bool = False
    image_skipped: list[dict[str, Any]] = field(default_factory=list)
    """Samples left out (length 0) for an image that cannot be used (``image_errors="skip"``):
    ``{"index", "dialogue_id", "source", "reason", "detail"}``, the detail naming file and turn."""

    def __len__(self) -> int:
        return len(self.lengths)


def dataset_fingerprint(dialogues: Sequence["Dialogue"]) -> str:
    """A fingerprint of the dialogues: the Arrow dataset's own fingerprint when the sequence
    exposes one (``fingerprint`` / ``_fingerprint``), else a hash of every record."""
    for attr in ("fingerprint", "_fingerprint"):
        value = getattr(dialogues, attr, None)
        if isinstance(value, str) and value:
            return value
    digest = hashlib.sha1()
    for dialogue in dialogues:
        digest.update(json.dumps(dialogue.to_record(), sort_keys=True).encode())
    return digest.hexdigest()


def adapter_fingerprint(adapter: "ModelAdapter") -> str:
    """The adapter's own ``fingerprint()`` when it has one, else family + tokenizer identity."""
    if hasattr(adapter, "fingerprint"):
        return adapter.fingerprint()
    tok = adapter.tokenizer
    state = [adapter.family, getattr(tok, "name_or_path", ""), len(tok), getattr(tok, "chat_template", None)]
    return hashlib.sha1(json.dumps(state, default=str).encode()).hexdigest()[:16]


def _key(fingerprint: str, adapter: "ModelAdapter", settings: dict[str, Any]) -> str:
    state = {"data": fingerprint, "adapter": adapter_fingerprint(adapter), **settings, "version": 2}
    return hashlib.sha1(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()[:20]


STAT_FIELDS = ("samples", "truncated", "skipped", "dropped_turns", "dropped_images")


def _stat_row(stats: TruncationStats) -> list[int]:
    return [int(getattr(stats, name)) for name in STAT_FIELDS]


@dataclass
class _Part:
    """The measured lengths of some dialogues, with each one's truncation counters."""

    lengths: np.ndarray
    full: np.ndarray
    images: np.ndarray
    stats: np.ndarray
    """int32 ``[n, len(STAT_FIELDS)]``: what truncation did to each dialogue."""
    skipped_ids: list[str]
    image_skipped: list[dict[str, Any]]

    @classmethod
    def empty(cls, n: int) -> "_Part":
        z = functools.partial(np.zeros, n, dtype=np.int32)
        return cls(z(), z(), z(), np.zeros((n, len(STAT_FIELDS)), dtype=np.int32), [], [])


def _measured(adapter, batch, max_length, truncation, system_prompt, part: _Part, start: int, image_errors: str):
    """Lengths from the adapter's ``measure_many`` (counts without building chunks)."""
    measured = _each_or_skip(batch, lambda some: adapter.measure_many(some, system_prompt=system_prompt),
                             start, image_errors, part.image_skipped)
    for i, measure in enumerate(measured):
        if measure is None:
            continue
        fixed, turn_lengths, turn_images, roles = measure
        part.full[i] = fixed + sum(turn_lengths)
        kept, stats = len(turn_lengths), TruncationStats(samples=1)
        if max_length is not None:
            stats = TruncationStats()
            kept = fit_turns(batch[i].id, fixed, turn_lengths, turn_images, roles, max_length, truncation, stats=stats)
        part.stats[i] = _stat_row(stats)
        part.skipped_ids += stats.skipped_ids
        if kept is not None:
            part.lengths[i] = fixed + sum(turn_lengths[:kept])
            part.images[i] = sum(turn_images[:kept])


def _encoded(adapter, batch, max_length, truncation, train_on, system_prompt, part: _Part, start: int,
             image_errors: str):
    """Lengths from the adapter's encoded chunks, truncated as the dataset truncates."""
    encoded_list = _each_or_skip(
        batch, lambda some: encode_dialogues(adapter, some, system_prompt=system_prompt, train_on=train_on),
        start, image_errors, part.image_skipped)
    for i, encoded in enumerate(encoded_list):
        if encoded is None:
            continue
        part.full[i] = encoded.length
        stats = TruncationStats(samples=1) if max_length is None else TruncationStats()
        kept = (truncate_dialogue(adapter, batch[i], encoded, max_length, truncation, system_prompt=system_prompt,
                                  stats=stats) if max_length is not None else encoded)
        part.stats[i] = _stat_row(stats)
        part.skipped_ids += stats.skipped_ids
        if kept is None:
            continue
        part.lengths[i] = kept.length
        part.images[i] = sum(isinstance(c, ImageChunk) for piece in (kept.prefix, kept.suffix) for c in piece) + sum(
            t.num_images for t in kept.turns
        )


def _lengths_of_range(
    adapter: "ModelAdapter",
    dialogues: Sequence["Dialogue"],
    bounds: tuple[int, int],
    *,
    max_length: int | None,
    truncation: str,
    train_on: str,
    system_prompt: str | None,
    image_errors: str = "strict",
) -> _Part:
    """The lengths of ``dialogues[start:stop]``, in one batched tokenizer call."""
    start, stop = bounds
    read_range = getattr(dialogues, "read_range", None)  # the Arrow cache reads a slice column by column
    batch = read_range(start, stop) if read_range else [dialogues[i] for i in range(start, stop)]
    part = _Part.empty(len(batch))
    if getattr(adapter, "measure_many", None) is not None:  # the adapter can count without building chunks
        _measured(adapter, batch, max_length, truncation, system_prompt, part, start, image_errors)
    else:
        _encoded(adapter, batch, max_length, truncation, train_on, system_prompt, part, start, image_errors)
    return part


def _each_or_skip(batch: list["Dialogue"], measure: Any, start: int, image_errors: str,
                  skipped: list[dict[str, Any]]) -> list[Any]:
    """``measure(batch)``; in skip mode, a batch with an image that cannot be used (a
    :class:`~mmtune.core.images.CorruptImageError`: unreadable, or refused by the image
    processor) is measured dialogue by dialogue and the failing ones become ``None``,
    recorded in ``skipped``. In strict mode the error (naming file, dialogue, turn) goes on."""
    try:
        return list(measure(batch))
    except CorruptImageError:
        if image_errors != "skip":
            raise
    out: list[Any] = []
    for k, dialogue in enumerate(batch):
        try:
            out.append(measure([dialogue])[0])
        except CorruptImageError as err:
            turn = f" {err.turn_text}" if err.turn is not None else ""
            skipped.append({"index": start + k, "dialogue_id": dialogue.id, "source": dialogue.source,
                            "reason": err.code, "detail": f"{err.path}{turn}: {err.__cause__ or err}"})
            out.append(None)
    return out


_FORKED = None


def _forked_job(bounds: tuple[int, int]):
    return _FORKED(bounds)


class _Subset(Sequence):
    """``dialogues`` at ``indices`` (the records whose images changed, measured again)."""

    def __init__(self, dialogues: Sequence["Dialogue"], indices: np.ndarray):
        self.dialogues, self.indices = dialogues, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        return self.dialogues[int(self.indices[i])]


def _run_ranges(job, ranges: list[tuple[int, int]], num_proc: int) -> list[_Part]:
    if num_proc > 1 and len(ranges) > 1:
        # fork: workers inherit the adapter and the dialogues (through _FORKED) instead of
        # receiving them pickled with every task
        global _FORKED
        _FORKED = job
        try:
            with multiprocessing.get_context("fork").Pool(min(num_proc, len(ranges))) as pool:
                return pool.map(_forked_job, ranges)
        finally:
            _FORKED = None
    return [job(r) for r in ranges]


def _stored(parts: list[_Part], stamps: np.ndarray) -> StoredLengths:
    def cat(name: str, width: int | None = None) -> np.ndarray:
        if parts:
            return np.concatenate([getattr(p, name) for p in parts])
        return np.zeros((0, width) if width else 0, dtype=np.int32)

    return StoredLengths(cat("lengths"), cat("full"), cat("images"), cat("stats", len(STAT_FIELDS)), stamps,
                         [i for p in parts for i in p.skipped_ids][:20],
                         [item for p in parts for item in p.image_skipped])


def _own_share(job, ranges: list[tuple[int, int]], num_proc: int, part: str) -> BaseException | None:
    """Measure and store this rank's chunks; the error that stopped it (also written for the
    other ranks, so none is left waiting at the barrier), or ``None``."""
    write_failure(part, None)  # a stale one of an earlier launch
    try:
        save_table(part, _stored(_run_ranges(job, ranges, num_proc), np.zeros(0, dtype=np.uint64)))
    except Exception as err:  # re-raised by the caller after the barrier
        write_failure(part, f"{type(err).__name__}: {err}")
        return err
    return None


def _measure(job, n: int, chunk_size: int, num_proc: int, stamps: np.ndarray, *, path: str | None,
             rank: int, world_size: int, barrier: Any) -> StoredLengths:
    """Every record measured: this rank's chunks, and with ``barrier`` the other ranks' read
    from their part files (see :mod:`mmtune.data.length_store`)."""
    ranges = [(start, min(n, start + chunk_size)) for start in range(0, n, chunk_size)]
    if world_size <= 1 or barrier is None or path is None:
        return _stored(_run_ranges(job, ranges, num_proc), stamps)
    failure = _own_share(job, ranges[rank::world_size], num_proc, part_path(path, rank, world_size))
    barrier()
    failed = [(r, read_failure(part_path(path, r, world_size))) for r in range(world_size)]
    if failure is not None:
        raise failure
    for r, message in failed:  # a rank that stopped (strict mode, an image it cannot count): every rank stops
        if message:
            raise RuntimeError(f"the length pass stopped on rank {r}: {message}")
    shares = [load_table(part_path(path, r, world_size)) for r in range(world_size)]
    barrier()  # every rank has read every part
    if rank == 0:
        for r in range(world_size):
            with contextlib.suppress(FileNotFoundError):
                os.remove(part_path(path, r, world_size))
    for r, share in enumerate(shares):  # a rank that measured other records (another key): measured here
        if share is None or len(share.lengths) != sum(b - a for a, b in ranges[r::world_size]):
            shares[r] = _stored(_run_ranges(job, ranges[r::world_size], num_proc), np.zeros(0, dtype=np.uint64))
    order = [(r, k) for r in range(world_size) for k in range(len(ranges[r::world_size]))]
    parts: list[_Part] = [None] * len(ranges)  # type: ignore[list-item]
    offsets = {r: np.cumsum([0] + [b - a for a, b in ranges[r::world_size]]) for r in range(world_size)}
    for r, k in order:
        a, b = offsets[r][k], offsets[r][k + 1]
        share = shares[r]
        lo, hi = ranges[r + k * world_size]
        parts[r + k * world_size] = _Part(share.lengths[a:b], share.full[a:b], share.images[a:b], share.stats[a:b],
                                          [], [it for it in share.image_skipped if lo <= it["index"] < hi])
    table = _stored(parts, stamps)
    table.skipped_ids = [i for share in shares for i in share.skipped_ids][:20]
    return table


def _table(stored: StoredLengths, key: str, from_cache: bool) -> LengthTable:
    totals = stored.stats.sum(axis=0) if len(stored.stats) else np.zeros(len(STAT_FIELDS), dtype=np.int64)
    stats = {name: int(v) for name, v in zip(STAT_FIELDS, totals)}
    return LengthTable(stored.lengths, stored.full, stored.images, key, stats, from_cache=from_cache,
                       image_skipped=stored.image_skipped)


def _remeasure_changed(stored: StoredLengths, stamps: np.ndarray, adapter: "ModelAdapter", dialogues,
                       options: dict[str, Any]) -> bool:
    """Measure again the records whose image stamp changed (:func:`measure_records`); whether any did."""
    changed = np.flatnonzero(stored.stamps != stamps)
    if not len(changed):
        return False
    stored.patch(changed, measure_records(adapter, dialogues, changed, **options))
    return True


def table_location(adapter: "ModelAdapter", dialogues: Sequence["Dialogue"], cache_dir: str, *,
                   fingerprint: str | None = None, max_length: int | None, truncation: str, train_on: str,
                   system_prompt: str | None, image_errors: str) -> tuple[str, str]:
    """``(key, path)`` of the stored length table of ``dialogues`` under these settings."""
    settings = {"max_length": max_length, "truncation": truncation, "train_on": train_on,
                "system_prompt": system_prompt, "n": len(dialogues)}
    if image_errors == "skip":  # a strict pass never stores a table with skips (it raises)
        settings["image_errors"] = image_errors
    key = _key(fingerprint or dataset_fingerprint(dialogues), adapter, settings)
    return key, os.path.join(cache_dir, f"lengths-{key}.npz")


def measure_records(adapter: "ModelAdapter", dialogues: Sequence["Dialogue"], indices: np.ndarray,
                    **options: Any) -> StoredLengths:
    """The lengths of ``dialogues`` at ``indices`` (in that order), their stamps included; the
    ``image_skipped`` entries name the records' own indices."""
    subset = _Subset(dialogues, indices)
    part = _lengths_of_range(adapter, subset, (0, len(subset)), **options)
    for item in part.image_skipped:
        item["index"] = int(indices[item["index"]])
    return StoredLengths(part.lengths, part.full, part.images, part.stats, image_stamps(subset), part.skipped_ids,
                         part.image_skipped)


def compute_lengths(
    adapter: "ModelAdapter",
    dialogues: Sequence["Dialogue"],
    *,
    max_length: int | None,
    truncation: str = "drop_trailing_turns",
    train_on: str = "all_assistant",
    system_prompt: str | None = None,
    cache_dir: str | None = None,
    fingerprint: str | None = None,
    chunk_size: int = 256,
    num_proc: int = 1,
    image_errors: str = "strict",
    rank: int = 0,
    world_size: int = 1,
    barrier: Any = None,
) -> LengthTable:
    """Length of every dialogue after template rendering, image expansion and truncation.

    Args:
        adapter: the model adapter.
        dialogues: random-access dialogues (e.g. ``SourceData.dialogues``).
        max_length, truncation, train_on, system_prompt: as the dataset will encode.
        cache_dir: where to store/load the table; ``None`` = no cache. A stored table's
            records whose images changed (path, size or time) are measured again.
        fingerprint: the dataset's fingerprint; computed when ``None`` and caching.
        chunk_size: dialogues per batched tokenizer call.
        num_proc: worker processes (fork); the result does not depend on it.
        image_errors: ``strict`` raises on an image the adapter cannot count (unreadable,
            or refused by its image processor); ``skip`` gives that sample length 0 and
            lists it in :attr:`LengthTable.image_skipped`.
        rank, world_size, barrier: with a ``cache_dir`` and a ``barrier`` (a callable every
            rank calls, e.g. ``torch.distributed.barrier``), each rank measures its share of
            the chunks and reads the others' (:mod:`mmtune.data.length_store`).

    Raises:
        SampleTooLongError: ``truncation="error"`` and some sample is too long.
        CorruptImageError: ``image_errors="strict"`` and an image cannot be counted (file,
            dialogue and turn named).
    """
    options = dict(max_length=max_length, truncation=truncation, train_on=train_on, system_prompt=system_prompt,
                   image_errors=image_errors)
    job = functools.partial(_lengths_of_range, adapter, dialogues, **options)
    if cache_dir is None:
        stored = _measure(job, len(dialogues), chunk_size, num_proc, np.zeros(len(dialogues), dtype=np.uint64),
                          path=None, rank=rank, world_size=world_size, barrier=None)
        return _table(stored, "", from_cache=False)
    key, path = table_location(adapter, dialogues, cache_dir, fingerprint=fingerprint, **options)
    stamps = image_stamps(dialogues)
    stored = load_table(path)
    if stored is not None:
        if _remeasure_changed(stored, stamps, adapter, dialogues, options) and rank == 0:
            save_table(path, stored)
        return _table(stored, key, from_cache=True)
    stored = _measure(job, len(dialogues), chunk_size, num_proc, stamps, path=path, rank=rank,
                      world_size=world_size, barrier=barrier)
    if rank == 0:
        save_table(path, stored)
    return _table(stored, key, from_cache=False)
