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

import functools
import hashlib
import json
import multiprocessing
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from mmtune.data.encoding import encode_dialogues
from mmtune.data.images import CorruptImageError
from mmtune.data.truncation import TruncationStats, fit_turns, truncate
from mmtune.core.encoded import ImageChunk

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.dialogue import Dialogue
    from mmtune.models.base import ModelAdapter

__all__ = ["LengthTable", "compute_lengths", "dataset_fingerprint", "adapter_fingerprint"]


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
    state = {"data": fingerprint, "adapter": adapter_fingerprint(adapter), **settings, "version": 1}
    return hashlib.sha1(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()[:20]


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
) -> tuple[np.ndarray, np.ndarray, np.ndarray, TruncationStats, list[dict[str, Any]]]:
    start, stop = bounds
    batch = [dialogues[i] for i in range(start, stop)]
    lengths = np.zeros(len(batch), dtype=np.int32)
    full = np.zeros(len(batch), dtype=np.int32)
    images = np.zeros(len(batch), dtype=np.int32)
    stats = TruncationStats()
    skipped: list[dict[str, Any]] = []
    measure_many = getattr(adapter, "measure_many", None)
    if measure_many is not None:  # the adapter can count without building chunks
        measured = _each_or_skip(batch, lambda some: measure_many(some, system_prompt=system_prompt),
                                 start, image_errors, skipped)
        for i, measure in enumerate(measured):
            if measure is None:
                continue
            fixed, turn_lengths, turn_images, roles = measure
            full[i] = fixed + sum(turn_lengths)
            kept = len(turn_lengths)
            if max_length is not None:
                kept = fit_turns(
                    batch[i].id, fixed, turn_lengths, turn_images, roles, max_length, truncation, stats=stats
                )
                if kept is None:
                    continue
            lengths[i] = fixed + sum(turn_lengths[:kept])
            images[i] = sum(turn_images[:kept])
        if max_length is None:
            stats.samples += len(batch)
        return lengths, full, images, stats, skipped
    encoded_list = _each_or_skip(
        batch, lambda some: encode_dialogues(adapter, some, system_prompt=system_prompt, train_on=train_on),
        start, image_errors, skipped)
    for i, encoded in enumerate(encoded_list):
        if encoded is None:
            continue
        full[i] = encoded.length
        kept = truncate(encoded, max_length, truncation, stats=stats) if max_length is not None else encoded
        if kept is None:
            continue
        lengths[i] = kept.length
        images[i] = sum(isinstance(c, ImageChunk) for part in (kept.prefix, kept.suffix) for c in part) + sum(
            t.num_images for t in kept.turns
        )
    if max_length is None:
        stats.samples += len(batch)
    return lengths, full, images, stats, skipped


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
) -> LengthTable:
    """Length of every dialogue after template rendering, image expansion and truncation.

    Args:
        adapter: the model adapter.
        dialogues: random-access dialogues (e.g. ``SourceData.dialogues``).
        max_length, truncation, train_on, system_prompt: as the dataset will encode.
        cache_dir: where to store/load the table; ``None`` = no cache.
        fingerprint: the dataset's fingerprint; computed when ``None`` and caching.
        chunk_size: dialogues per batched tokenizer call.
        num_proc: worker processes (fork); the result does not depend on it.
        image_errors: ``strict`` raises on an image the adapter cannot count (unreadable,
            or refused by its image processor); ``skip`` gives that sample length 0 and
            lists it in :attr:`LengthTable.image_skipped`.

    Raises:
        SampleTooLongError: ``truncation="error"`` and some sample is too long.
        CorruptImageError: ``image_errors="strict"`` and an image cannot be counted (file,
            dialogue and turn named).
    """
    settings = {
        "max_length": max_length,
        "truncation": truncation,
        "train_on": train_on,
        "system_prompt": system_prompt,
        "n": len(dialogues),
    }
    if image_errors == "skip":  # a strict pass never stores a table with skips (it raises)
        settings["image_errors"] = image_errors
    key = ""
    path = None
    if cache_dir is not None:
        key = _key(fingerprint or dataset_fingerprint(dialogues), adapter, settings)
        path = os.path.join(cache_dir, f"lengths-{key}.npz")
        if os.path.exists(path):
            with np.load(path) as data:
                stats = json.loads(str(data["stats"]))
                skipped = json.loads(str(data["image_skipped"])) if "image_skipped" in data else []
                return LengthTable(
                    data["lengths"], data["full_lengths"], data["num_images"], key, stats, from_cache=True,
                    image_skipped=skipped,
                )

    n = len(dialogues)
    job = functools.partial(
        _lengths_of_range, adapter, dialogues, max_length=max_length, truncation=truncation,
        train_on=train_on, system_prompt=system_prompt, image_errors=image_errors,
    )
    ranges = [(start, min(n, start + chunk_size)) for start in range(0, n, chunk_size)]
    if num_proc > 1 and len(ranges) > 1:
        # fork: workers inherit the adapter and the dialogues (through _FORKED) instead of
        # receiving them pickled with every task
        global _FORKED
        _FORKED = job
        try:
            with multiprocessing.get_context("fork").Pool(num_proc) as pool:
                parts = pool.map(_forked_job, ranges)
        finally:
            _FORKED = None
    else:
        parts = [job(r) for r in ranges]
    lengths = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int32)
    full = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int32)
    images = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, dtype=np.int32)
    stats = TruncationStats()
    for part in parts:
        stats += part[3]
    table = LengthTable(lengths, full, images, key, stats.as_dict(),
                        image_skipped=[item for part in parts for item in part[4]])
    if path is not None:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp.npz")
        os.close(fd)
        extra = {"image_skipped": json.dumps(table.image_skipped)} if table.image_skipped else {}
        np.savez(tmp, lengths=lengths, full_lengths=full, num_images=images, stats=json.dumps(table.stats), **extra)
        os.replace(tmp, path)
    return table
