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
from mmtune.data.truncation import TruncationStats, fit_turns, truncate
from mmtune.models.base import ImageChunk

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
) -> tuple[np.ndarray, np.ndarray, np.ndarray, TruncationStats]:
    start, stop = bounds
    batch = [dialogues[i] for i in range(start, stop)]
    lengths = np.zeros(len(batch), dtype=np.int32)
    full = np.zeros(len(batch), dtype=np.int32)
    images = np.zeros(len(batch), dtype=np.int32)
    stats = TruncationStats()
    measure_many = getattr(adapter, "measure_many", None)
    if measure_many is not None:  # the adapter can count without building chunks
        for i, (fixed, turn_lengths, turn_images, roles) in enumerate(
            measure_many(batch, system_prompt=system_prompt)
        ):
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
        return lengths, full, images, stats
    for i, encoded in enumerate(encode_dialogues(adapter, batch, system_prompt=system_prompt, train_on=train_on)):
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
    return lengths, full, images, stats


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

    Raises:
        SampleTooLongError: ``truncation="error"`` and some sample is too long.
    """
    settings = {
        "max_length": max_length,
        "truncation": truncation,
        "train_on": train_on,
        "system_prompt": system_prompt,
        "n": len(dialogues),
    }
    key = ""
    path = None
    if cache_dir is not None:
        key = _key(fingerprint or dataset_fingerprint(dialogues), adapter, settings)
        path = os.path.join(cache_dir, f"lengths-{key}.npz")
        if os.path.exists(path):
            with np.load(path) as data:
                stats = json.loads(str(data["stats"]))
                return LengthTable(
                    data["lengths"], data["full_lengths"], data["num_images"], key, stats, from_cache=True
                )

    n = len(dialogues)
    job = functools.partial(
        _lengths_of_range, adapter, dialogues, max_length=max_length, truncation=truncation,
        train_on=train_on, system_prompt=system_prompt,
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
    table = LengthTable(lengths, full, images, key, stats.as_dict())
    if path is not None:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp.npz")
        os.close(fd)
        np.savez(tmp, lengths=lengths, full_lengths=full, num_images=images, stats=json.dumps(table.stats))
        os.replace(tmp, path)
    return table
