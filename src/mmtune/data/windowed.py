"""An epoch's batch plan built window by window: training starts after the first window.

The whole-epoch plan (:func:`~mmtune.data.batching.build_plan`) needs the length of every
sample before step 1: for the paper's 710k-record mix that pass is minutes on a cold start.
Yet every plan mode but ``length_grouped`` is a sequence of independent windows over the
epoch's order of trainable samples: a packing window (``collator.packing_window`` samples), a
token-budget megabatch (``batch_size x megabatch_mult``), a padding batch. :class:`WindowedPlan`
yields exactly the whole plan's batches, measuring the lengths of a window's records
(:class:`MeasuredLengths`) only when it plans that window, so the first step waits for one
window. The plan of a window is a pure function of its records, their lengths and the seed:
a resumed run plans the windows before its position again (their lengths read back from the
length cache) and continues exactly.

:class:`RankStream` deals the windowed epoch out as :func:`~mmtune.data.batching.rank_plan`
deals a whole one (batches ``rank, rank + W, ...``, then fillers up to whole optimizer steps),
and hashes the plan as it goes: a checkpoint records the hash of the batches before its
position, which a resume compares.

What the windowed plan gives up: the number of steps of an epoch is known only once its last
window is planned, so the learning-rate schedule needs its own length (``training.max_steps``),
and the data report counts truncation over the samples measured so far. With several ranks,
each rank measures the windows it plans (the same records on every rank); measured lengths
are stored in the length cache as they come, so later launches and resumes read them back.
"""

from __future__ import annotations

import collections
import hashlib
import os
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np

from mmtune.data.batching import Batch, build_plan, pack_window, steps_per_epoch
from mmtune.data.length_store import StoredLengths, image_stamps, load_table, save_table
from mmtune.data.lengths import STAT_FIELDS, LengthTable, measure_records, table_location

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.mixture import Mixture
    from mmtune.models.base import ModelAdapter

__all__ = ["MeasuredLengths", "WindowedPlan", "RankStream", "plan_unit", "windowed_problem"]

#: records measured between two writes of the partial length table (rank 0)
SAVE_EVERY = 20_000


def plan_unit(config: Any) -> int:
    """Samples of one independent plan window for ``config.batching`` (a CollatorConfig)."""
    return {"packing": config.packing_window, "token_budget": config.batch_size * config.megabatch_mult,
            "padding": config.batch_size}[config.batching]


def windowed_problem(config: Any, max_steps: Optional[int]) -> str:
    """Why ``collator.plan=windowed`` cannot plan this run ('' when it can)."""
    if max_steps is None:
        return ("collator.plan=windowed needs training.max_steps: the schedule's length would be the epoch's step "
                "count, known only after its last window is planned. Set training.max_steps, or "
                "collator.plan=whole")
    if config.batching == "length_grouped":
        return ("collator.plan=windowed cannot plan collator.batching=length_grouped (it moves the epoch's longest "
                "batch first); use packing, token_budget or padding, or collator.plan=whole")
    if config.truncation == "error":
        return ("collator.plan=windowed with collator.truncation=error would find a too-long dialogue mid-run; "
                "use collator.plan=whole to have every one named at start-up")
    return ""


def _partial_path(path: str) -> str:
    return f"{path[:-len('.npz')]}.partial.npz"


class MeasuredLengths:
    """The mixture's per-sample lengths (global index order), measured on demand and remembered.

    Stored tables (whole or partial) of each source are read back at start, their records
    whose image stamp changed measured again; rank 0 writes what was measured as it goes
    (``lengths-<key>.partial.npz``), and the whole table once every record is measured.
    """

    def __init__(self, adapter: "ModelAdapter", mixture: "Mixture", options: dict[str, Any],
                 cache_dir: Optional[str], *, rank: int = 0):
        self.adapter, self.mixture, self.options, self.rank = adapter, mixture, options, rank
        n = len(mixture.dialogues)
        self.offsets = np.cumsum([0] + [len(s.dialogues) for s in mixture.sources])
        z = lambda: np.zeros(n, dtype=np.int32)  # noqa: E731
        self.table = StoredLengths(z(), z(), z(), np.zeros((n, len(STAT_FIELDS)), dtype=np.int32),
                                   np.zeros(n, dtype=np.uint64), [], [])
        self.measured = np.zeros(n, dtype=bool)
        self.paths = ([table_location(adapter, s.dialogues, cache_dir, **options)[1] for s in mixture.sources]
                      if cache_dir else [])
        for k, path in enumerate(self.paths):
            self._read_back(k, path)
        self._unsaved = 0

    def __len__(self) -> int:
        return len(self.measured)

    @property
    def lengths(self) -> np.ndarray:
        return self.table.lengths

    @property
    def num_images(self) -> np.ndarray:
        return self.table.images

    def _read_back(self, k: int, path: str) -> None:
        stored = load_table(path)
        mask = None
        if stored is None and os.path.exists(_partial_path(path)):
            stored = load_table(_partial_path(path))
            with np.load(_partial_path(path)) as data:
                mask = data["measured"]
        if stored is None:
            return
        a, b = self.offsets[k], self.offsets[k + 1]
        mask = np.ones(b - a, dtype=bool) if mask is None else mask.copy()
        mask &= stored.stamps == image_stamps(self.mixture.sources[k].dialogues)  # an image changed: measure again
        local = np.flatnonzero(mask)
        self._put(local + a, StoredLengths(stored.lengths[local], stored.full[local], stored.images[local],
                                           stored.stats[local], stored.stamps[local], [],
                                           [{**it, "index": int(it["index"]) + int(a)} for it in stored.image_skipped
                                            if mask[int(it["index"])]]))

    def _put(self, indices: np.ndarray, part: StoredLengths) -> None:
        for name in ("lengths", "full", "images", "stats", "stamps"):
            getattr(self.table, name)[indices] = getattr(part, name)
        self.table.image_skipped += part.image_skipped
        self.table.skipped_ids = (self.table.skipped_ids + part.skipped_ids)[:20]
        self.measured[indices] = True

    def ensure(self, indices: np.ndarray) -> None:
        """Measure the records of ``indices`` not measured yet (strict image errors raise, naming them)."""
        todo = np.unique(indices[~self.measured[indices]])
        for k, source in enumerate(self.mixture.sources):
            a, b = self.offsets[k], self.offsets[k + 1]
            own = todo[(todo >= a) & (todo < b)]
            if len(own):
                part = measure_records(self.adapter, source.dialogues, own - a, **self.options)
                for item in part.image_skipped:
                    item["index"] = int(item["index"]) + int(a)
                self._put(own, part)
        self._unsaved += len(todo)
        if self._unsaved >= SAVE_EVERY or (len(todo) and self.measured.all()):
            self.save()

    def _source_part(self, k: int) -> StoredLengths:
        """Source ``k``'s entries, its image skips numbered within the source (as its stored table)."""
        a, b = self.offsets[k], self.offsets[k + 1]
        t = self.table
        return StoredLengths(t.lengths[a:b], t.full[a:b], t.images[a:b], t.stats[a:b], t.stamps[a:b], t.skipped_ids,
                             [{**it, "index": int(it["index"]) - int(a)} for it in t.image_skipped
                              if a <= it["index"] < b])

    def save(self) -> None:
        """Rank 0 stores what was measured: each source's whole table, or a partial one."""
        self._unsaved = 0
        if self.rank != 0:
            return
        for k, path in enumerate(self.paths):
            measured = self.measured[self.offsets[k]:self.offsets[k + 1]]
            if measured.all():
                save_table(path, self._source_part(k))
                if os.path.exists(_partial_path(path)):
                    os.remove(_partial_path(path))
            elif measured.any():
                save_table(_partial_path(path), self._source_part(k), extra={"measured": measured})

    def source_tables(self) -> tuple[list[LengthTable], list[np.ndarray]]:
        """Each source's table and mask of measured records (for the data report)."""
        tables, masks = [], []
        for k in range(len(self.mixture.sources)):
            part, mask = self._source_part(k), self.measured[self.offsets[k]:self.offsets[k + 1]]
            stats = {name: int(v) for name, v in zip(STAT_FIELDS, part.stats[mask].sum(axis=0))}
            tables.append(LengthTable(part.lengths, part.full, part.images, "", stats,
                                      image_skipped=part.image_skipped))
            masks.append(mask)
        return tables, masks


class WindowedPlan:
    """One epoch's global batches (:data:`~mmtune.data.batching.Plan` order), planned window by
    window over ``order`` (the mixture's order of the epoch), equal to ``build_plan`` of the whole."""

    measure_chunk = 1024
    """Records of the order measured at a time (at least one window's): one batched tokenizer call."""

    def __init__(self, order: np.ndarray, lengths: MeasuredLengths, config: Any):
        self.order, self.lengths, self.config = np.asarray(order), lengths, config
        self.unit = plan_unit(config)
        self.chunk = max(self.unit, self.measure_chunk)
        self.position = 0  # of the order measured so far
        self.pending: list[int] = []  # trainable samples measured and not planned yet

    def _next_window(self) -> Optional[list[int]]:
        while len(self.pending) < self.unit and self.position < len(self.order):
            chunk = self.order[self.position:self.position + self.chunk]
            self.position += len(chunk)
            self.lengths.ensure(chunk)
            self.pending += chunk[self.lengths.lengths[chunk] > 0].tolist()
        if not self.pending:
            return None
        window, self.pending = self.pending[:self.unit], self.pending[self.unit:]
        return window

    def __iter__(self) -> Iterator[Batch]:
        c, lengths = self.config, self.lengths
        if c.batching != "packing":  # one window is one padding batch or one token-budget megabatch
            while (window := self._next_window()) is not None:
                yield from build_plan(window, lengths.lengths, c, num_images=lengths.num_images)
            return
        cap = None if c.max_images_per_batch is None else max(1, c.max_images_per_batch // c.batch_size)
        rows: list[list[int]] = []
        while (window := self._next_window()) is not None:
            size = {i: int(lengths.lengths[i]) for i in window}
            images = {i: int(lengths.num_images[i]) for i in window}
            rows += pack_window(window, size, images, c.max_length, cap, max_images=c.max_images_per_batch,
                                rows_per_batch=c.batch_size)
            while len(rows) >= c.batch_size:
                yield tuple(tuple(r) for r in rows[:c.batch_size])
                rows = rows[c.batch_size:]
        if rows and not c.drop_last:
            yield tuple(tuple(r) for r in rows)


class RankStream:
    """One rank's micro-batches of a windowed epoch, as ``rank_plan`` deals a whole one.

    Rank ``r`` of ``W`` takes the epoch's batches ``r, r + W, ...`` as they are planned; after
    the last window, it is topped up with fillers (a repeat of its last batch) to the same
    whole number of optimizer steps as every rank. The plan is hashed as it is produced:
    :meth:`hash_at` is the hash of its first ``k`` batches and the global batch.
    """

    def __init__(self, plan: WindowedPlan, rank: int, world_size: int, accumulation: int):
        self.plan, self._source = plan, iter(plan)
        self.rank, self.world_size, self.accumulation = rank, world_size, accumulation
        self.produced, self.exhausted, self.started = 0, False, False
        self._own: collections.deque = collections.deque()  # (micro-batch index, batch) not served yet
        self._own_count, self._last_own = 0, None
        self._first: list[Batch] = []  # the first W batches: a rank without any repeats one
        self._digest = hashlib.sha1(f"windowed|{world_size * accumulation}|".encode())
        self._hashes: dict[int, str] = {0: self._digest.hexdigest()}

    def _advance(self) -> bool:
        """Plan one batch more; ``False`` once the epoch's plan is exhausted."""
        if self.exhausted:
            return False
        batch = next(self._source, None)
        if batch is None:
            self.exhausted = True
            self._hashes[self.produced] = self._digest.hexdigest()
            return False
        if self.produced % self.world_size == self.rank:
            self._own.append((self._own_count, batch))
            self._own_count += 1
            self._last_own = batch
        if len(self._first) < self.world_size:
            self._first.append(batch)
        self.produced += 1
        self._digest.update(repr(batch).encode() + b"\n")
        if self.produced % (self.world_size * self.accumulation) == 0:
            self._hashes[self.produced] = self._digest.hexdigest()
        return True

    def hash_at(self, k: int) -> str:
        """The hash of the epoch's first ``k`` batches (all of them when ``k`` is past the end)."""
        while self.produced < k and self._advance():
            pass
        return self._hashes[min(k, self.produced)]

    def first_batch_exists(self) -> bool:
        while not self.produced and self._advance():
            pass
        return self.produced > 0

    def micro_batches(self, start: int = 0) -> Iterator[tuple[Batch, bool]]:
        """``(batch, is_filler)`` from this rank's micro-batch ``start`` to the epoch's end (once per stream)."""
        self.started = True
        while True:
            while not self._own and self._advance():
                pass
            if not self._own:
                break
            index, batch = self._own.popleft()
            if index >= start:
                yield batch, False
        steps = steps_per_epoch(self.produced, self.world_size, self.accumulation)
        filler = self._last_own or (self._first[self.rank % len(self._first)] if self._first else None)
        for _ in range(max(self._own_count, start), steps * self.accumulation):
            yield filler, True
