"""What the data pipeline left out of a training run, per source and per reason.

Data is lost at three places, and each is counted here so a run never shrinks silently:

1. reading: records skipped by validation (``skip`` mode), per problem code;
2. fitting the window: samples whose first exchange alone does not fit (they train on
   nothing), and turns / images cut from the end of samples that were truncated;
3. loading: samples dropped because an image cannot be used (``skip`` mode), with the
   file, record and turn: found by the length pass (an image the processor refuses, e.g.
   an aspect ratio above Qwen-VL's 200) or while training (an image that fails to decode).

:func:`lengths_per_source` measures each source on its own so the truncation counts
are per source; :class:`DataLossReport` renders the start-up summary, is written to
``<output_dir>/data_report.json`` and explains a run whose data all got dropped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from mmtune.io.nofollow import open_output

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.lengths import LengthTable
    from mmtune.data.mixture import Mixture

__all__ = ["SourceLoss", "DataLossReport", "lengths_per_source"]


def _refuse_too_long(mixture: "Mixture", tables: list["LengthTable"], max_length: Optional[int]) -> None:
    """Raise :class:`~mmtune.data.truncation.SampleTooLongError` naming every dialogue longer
    than ``max_length`` (file, record id, tokens), when there is one (``collator.truncation: error``)."""
    from mmtune.data.truncation import SampleTooLongError

    if max_length is None:
        return
    named: list[str] = []
    count = 0
    for source, table in zip(mixture.sources, tables):
        refused = {int(item["index"]) for item in table.image_skipped}
        for i in np.flatnonzero(np.asarray(table.full_lengths) > max_length):
            if int(i) in refused:
                continue
            count += 1
            if len(named) < 20:
                named.append(f"{source.config.path} record {source.dialogues[int(i)].id!r} "
                             f"({int(table.full_lengths[i])} tokens)")
    if count:
        more = f"\n  ... and {count - len(named)} more" if count > len(named) else ""
        raise SampleTooLongError(
            f"{count} dialogue(s) longer than collator.max_length={max_length} tokens (one row, template and image "
            "tokens included; with training.sequence_parallel.size=N the row is split over N GPUs, not lengthened), "
            "and collator.truncation=error refuses them:\n  " + "\n  ".join(named) + more
            + "\nshorten or split them, raise collator.max_length (and training.sequence_parallel.size to keep each "
            "GPU's share), or set collator.truncation to skip_sample or drop_trailing_turns")


@dataclass
class SourceLoss:
    """Losses of one source."""

    source: str
    records_read: int = 0
    records_kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    """Records left out when reading, per reason (first problem of the record)."""
    skipped_records: dict[str, list[str]] = field(default_factory=dict)
    """The records behind those counts, per problem: ``"<record id> <turn>: <detail>"``, as
    ``mmtune data check`` lists them (up to ``data.validation.max_examples`` per problem;
    a record with several problems is named under each)."""
    samples: int = 0
    """Samples (records kept, after stacking) measured against the window."""
    not_measured: int = 0
    """Samples not measured yet: a windowed plan (``collator.plan``) measures them as it
    plans their window, so its report at start-up covers the first window's records."""
    no_window: int = 0
    """Samples that fit no window: their first exchange alone is too long (or truncation
    is ``skip_sample``). They are never trained on."""
    no_window_ids: list[str] = field(default_factory=list)
    no_window_examples: list[str] = field(default_factory=list)
    """The first of them named with their length: ``"<record id> (<tokens> tokens)"``."""
    path: str = ""
    """The source's data file."""
    truncated: int = 0
    """Samples kept with trailing turns cut."""
    dropped_turns: int = 0
    dropped_images: int = 0
    corrupt_images: int = 0
    """Samples dropped during training because an image failed to decode (skip mode)."""
    corrupt_examples: list[str] = field(default_factory=list)
    refused_images: int = 0
    """Samples left out before training because an image cannot be used: the length pass
    could not count its tokens (the image processor refuses it, or it cannot be read; skip mode)."""
    refused_examples: list[str] = field(default_factory=list)


@dataclass
class DataLossReport:
    """Per-source losses of one run (see the module docstring)."""

    max_length: Optional[int]
    sources: list[SourceLoss]

    @classmethod
    def build(cls, mixture: "Mixture", tables: list["LengthTable"], max_length: Optional[int], *,
              measured: Optional[list[np.ndarray]] = None) -> "DataLossReport":
        """The report of ``tables`` (one per source); with ``measured`` (a windowed plan's masks of
        the records measured so far) of those records only, the others counted as not measured."""
        out = []
        for k, (source, table) in enumerate(zip(mixture.sources, tables)):
            report = source.report
            stats = table.stats or {}
            mask = measured[k] if measured is not None else np.ones(len(table), dtype=bool)
            refused = {int(item["index"]) for item in table.image_skipped}
            zero = [int(i) for i in np.flatnonzero((table.lengths == 0) & mask) if int(i) not in refused]
            out.append(SourceLoss(
                source=source.name, records_read=report.records_read, records_kept=report.records_kept,
                skipped=dict(report.skipped), skipped_records={code: list(examples) for code, examples in
                                                               report.examples.items() if examples},
                samples=int(mask.sum()), not_measured=int(len(table) - mask.sum()), no_window=len(zero),
                no_window_ids=[source.dialogues[i].id for i in zero[:5]],
                no_window_examples=[f"{source.dialogues[i].id!r} ({int(table.full_lengths[i])} tokens)"
                                    for i in zero[:5]],
                path=str(source.config.path),
                truncated=int(stats.get("truncated", 0)), dropped_turns=int(stats.get("dropped_turns", 0)),
                dropped_images=int(stats.get("dropped_images", 0)), refused_images=len(refused),
                refused_examples=[f"{item['dialogue_id']}: {item['detail']}" for item in table.image_skipped[:20]],
            ))
        return cls(max_length, out)

    # -- training-time skips -------------------------------------------------------------
    def add_skipped(self, skipped: list[dict[str, Any]]) -> None:
        """Count samples dropped while loading (``meta["skipped"]`` of a batch)."""
        for item in skipped:
            loss = next((s for s in self.sources if s.source == item.get("source")), None) or self.sources[0]
            loss.corrupt_images += 1
            if len(loss.corrupt_examples) < 20:
                loss.corrupt_examples.append(f"{item['dialogue_id']}: {item['detail']}")

    @property
    def trainable_samples(self) -> int:
        return sum(s.samples - s.no_window - s.refused_images for s in self.sources)

    @property
    def corrupt_images(self) -> int:
        return sum(s.corrupt_images for s in self.sources)

    def why_empty(self) -> str:
        """Why no sample is left to train on, source by source, with what to change."""
        lines = ["no training sample is left after reading and fitting the data:"]
        for s in self.sources:
            reasons = ", ".join(f"{code} {n}" for code, n in sorted(s.skipped.items(), key=lambda kv: -kv[1]))
            if s.records_read == 0:
                lines.append(f"  - source {s.source}: the data file has no records")
            elif s.records_kept == 0:
                lines.append(f"  - source {s.source}: all {s.records_read} records were skipped when reading "
                             f"({reasons}); run `mmtune data check` on it for examples and fixes")
            elif s.refused_images and s.no_window + s.refused_images == s.samples:
                lines.append(f"  - source {s.source}: {s.refused_images} samples have an image that cannot be used "
                             f"(e.g. {s.refused_examples[0]})" + (f" and {s.no_window} fit no window" if s.no_window
                                                                  else ""))
            elif s.no_window == s.samples:
                lines.append(f"  - source {s.source}: all {s.samples} samples are longer than the "
                             f"{self.max_length}-token window even with one exchange (e.g. {', '.join(s.no_window_ids)}); "
                             "raise collator.max_length / context.max_length or shorten the samples")
        return "\n".join(lines)

    def render(self) -> str:
        """The start-up summary: one block per source, only the losses that happened."""
        lines = [f"data: {self.trainable_samples} trainable samples (window {self.max_length} tokens)"]
        waiting = sum(s.not_measured for s in self.sources)
        if waiting:
            lines[0] = (f"data: {self.trainable_samples} trainable of the {sum(s.samples for s in self.sources)} "
                        f"samples measured so far, {waiting} more measured window by window as they are planned "
                        f"(collator.plan; window {self.max_length} tokens)")
        for s in self.sources:
            parts = [f"records read {s.records_read}, kept {s.records_kept}"]
            if s.skipped:
                first = next((examples[0] for examples in s.skipped_records.values() if examples), None)
                parts.append("skipped " + ", ".join(f"{code} {n}" for code, n in sorted(s.skipped.items(), key=lambda kv: -kv[1]))
                             + (f" (e.g. {first}; each named in data_report.json)" if first else ""))
            if s.no_window:
                parts.append(f"{s.no_window} samples fit no window (e.g. {s.path} record "
                             f"{', '.join(s.no_window_examples or s.no_window_ids)})")
            if s.truncated:
                parts.append(f"{s.truncated} samples truncated: {s.dropped_turns} turns, {s.dropped_images} images dropped")
            if s.refused_images:
                parts.append(f"{s.refused_images} samples left out for an image that cannot be used "
                             f"(e.g. {s.refused_examples[0]})")
            if s.corrupt_images:
                parts.append(f"{s.corrupt_images} samples dropped for an image that failed to decode")
            lines.append(f"  {s.source}: " + "; ".join(parts))
        return "\n".join(lines)

    def render_skipped(self) -> str:
        """End-of-training lines about samples dropped while loading."""
        lines = [f"{self.corrupt_images} samples left out during training because an image failed to decode:"]
        for s in self.sources:
            for example in s.corrupt_examples[:5]:
                lines.append(f"  {s.source}: {example}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"max_length": self.max_length, "trainable_samples": self.trainable_samples,
                "sources": [asdict(s) for s in self.sources]}

    def write(self, path: str) -> None:
        with open_output(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)


def lengths_per_source(adapter: Any, mixture: "Mixture", **kwargs: Any) -> tuple["LengthTable", list["LengthTable"]]:
    """Exact lengths of every sample (global index order) and each source's own table.

    Measuring source by source gives per-source truncation counts; lengths are the same
    as measuring the concatenation (a sample's length depends on that sample only).
    """
    from mmtune.data.lengths import LengthTable, compute_lengths

    refuse = kwargs.get("truncation") == "error"
    if refuse:  # measured as skip_sample, so every dialogue too long is named, not only the first
        kwargs = {**kwargs, "truncation": "skip_sample"}
    tables = [compute_lengths(adapter, source.dialogues, **kwargs) for source in mixture.sources]
    if refuse:
        _refuse_too_long(mixture, tables, kwargs.get("max_length"))
    offsets = np.cumsum([0] + [len(t) for t in tables])
    stats: dict[str, int] = {}
    for table in tables:
        for key, value in (table.stats or {}).items():
            stats[key] = stats.get(key, 0) + int(value)

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(t, name) for t in tables]) if tables else np.zeros(0, dtype=np.int32)

    key = hashlib.sha1("|".join(t.key for t in tables).encode()).hexdigest()[:16]
    combined = LengthTable(cat("lengths"), cat("full_lengths"), cat("num_images"), key, stats,
                           from_cache=bool(tables) and all(t.from_cache for t in tables),
                           image_skipped=[{**item, "index": int(offset) + int(item["index"])}
                                          for table, offset in zip(tables, offsets) for item in table.image_skipped])
    return combined, tables
