"""One large source read by several processes into the cache entry one process would write.

Converting and checking records (:func:`mmtune.data.readers._checked_records`) costs tens of
microseconds a record in Python, so a llava-665k-sized file takes most of a minute on one
core. With ``data.num_proc`` above 1 the records are dealt out in blocks of :data:`BLOCK`
positions: forked worker ``w`` of ``P`` parses the whole file (the only way to know where
the records of a JSON list are) but converts, checks and writes only the blocks ``b`` with
``b % P == w``, each into its own Arrow shard. The parent then writes the entry: the blocks'
rows in file order, each record's key (:mod:`mmtune.data.keys`, given in file order from the
ids and content hashes the workers return) and the workers' reports merged, with the first
examples and the first problem of the file, as one process would find them. That merge runs
in a worker too, so the training process never holds the records or their ids. So the entry,
its report, and a strict run's error do not depend on the number of processes.

Used for training sources (``unique_ids=False``) of at least :data:`MIN_PARALLEL_BYTES`
without ``drop_exact_duplicates`` (whose drops are decided in file order); anything else is
read by one process.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from mmtune.data.cache import CacheWriter
from mmtune.data.keys import content_hash, keys_in_file_order
from mmtune.data.validation import DataValidationError, Problem, ValidationReport

__all__ = ["BLOCK", "MIN_PARALLEL_BYTES", "ReadJob", "available_cores", "input_bytes", "read_in_parallel"]

BLOCK = 2048
"""Records per block dealt to one worker (long enough that a worker's skipped blocks cost
little more than their parsing)."""

MIN_PARALLEL_BYTES = 16 << 20
"""Smallest input read by several processes: below it, forking costs more than it saves."""

Records = Callable[[Callable[[int], bool]], Iterator[tuple[int, Any, list[Problem]]]]


def available_cores() -> int:
    """The cores this process may use (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def input_bytes(files: list[str]) -> int:
    """The size of an input's files (what decides whether it is read in parallel)."""
    return sum(os.path.getsize(f) for f in files if os.path.isfile(f))


@dataclass
class ReadJob:
    """What every worker needs: ``records(wanted)`` yields ``(position, dialogue, problems)``
    for the positions ``wanted`` accepts (:func:`~mmtune.data.readers._checked_records`)."""

    records: Records
    workers: int
    mode: str
    path: str
    new_report: Callable[[], ValidationReport]
    shard_base: str


@dataclass
class _Share:
    """What one worker read: its shard, its rows per block, and what the parent needs of each
    kept record (position, id, content hash) and of its report."""

    shard: str
    rows_per_block: dict[int, int]
    positions: np.ndarray
    ids: Any
    """The kept records' ids: a list while reading, an Arrow array when returned."""
    contents: np.ndarray
    report: ValidationReport
    example_positions: dict[str, list[int]] = field(default_factory=dict)
    first_problem_at: int | None = None
    failure: tuple[int, str] | None = None


def _read_share(job: ReadJob, worker: int) -> _Share:
    """Convert, check and write the records of ``worker``'s blocks."""
    shard = f"{job.shard_base}.part{worker}.arrow"
    writer = CacheWriter(shard, shard + ".report.json")
    report = job.new_report()
    share = _Share(shard, {}, np.zeros(0, np.int64), [], np.zeros(0, np.int64), report)
    positions: list[int] = []
    contents: list[int] = []
    try:
        for position, dialogue, problems in job.records(lambda p: (p // BLOCK) % job.workers == worker):
            if problems:
                if job.mode == "strict":
                    share.failure = (position, problems[0].message(job.path))
                    break
                _add_skipped(share, position, problems)
                continue
            report.add_kept(dialogue)
            writer.add_dialogue(dialogue)
            block = position // BLOCK
            share.rows_per_block[block] = share.rows_per_block.get(block, 0) + 1
            positions.append(position)
            share.ids.append(dialogue.id)
            contents.append(content_hash(dialogue))
        writer.commit({})
    except BaseException:
        writer.abort()
        raise
    share.positions = np.asarray(positions, dtype=np.int64)
    share.contents = np.asarray(contents, dtype=np.int64)
    share.ids = pa.array(share.ids, pa.string())  # pickled as buffers, joined in C
    return share


def _add_skipped(share: _Share, position: int, problems: list[Problem]) -> None:
    """Count a skipped record, remembering where the report's examples and first problem are."""
    report = share.report
    before = {code: len(found) for code, found in report.examples.items()}
    if report.first_problem is None:
        share.first_problem_at = position
    report.add_skipped(problems)
    for code, found in report.examples.items():
        if len(found) > before.get(code, 0):
            share.example_positions.setdefault(code, []).append(position)


def _merged_report(shares: list[_Share], report: ValidationReport) -> ValidationReport:
    """The workers' reports as one process's: counts summed, examples and the first problem
    the earliest in the file."""
    examples: dict[str, list[tuple[int, str]]] = {}
    for share in shares:
        part = share.report
        for name in ("records_read", "records_kept", "turns", "images", "text_only"):
            setattr(report, name, getattr(report, name) + getattr(part, name))
        for name in ("problems", "skipped"):
            total = getattr(report, name)
            for code, n in getattr(part, name).items():
                total[code] = total.get(code, 0) + n
        for code, found in part.examples.items():
            examples.setdefault(code, []).extend(zip(share.example_positions.get(code, []), found))
    report.examples = {code: [text for _, text in sorted(found)[:report.max_examples]]
                       for code, found in examples.items()}
    firsts = [(s.first_problem_at, s.report.first_problem) for s in shares if s.first_problem_at is not None]
    report.first_problem = min(firsts)[1] if firsts else None
    return report


_JOB: ReadJob | None = None


def _forked_share(worker: int) -> str:
    """Read ``worker``'s blocks; its :class:`_Share` is written beside its shard (the parent
    never holds the records' ids), and the file's path returned."""
    assert _JOB is not None
    share = _read_share(_JOB, worker)
    path = share.shard + ".share.pkl"
    with open(path, "wb") as f:
        pickle.dump(share, f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def _forked_entry(share_paths: list[str], arrow_path: str, report_path: str, max_examples: int) -> ValidationReport:
    """The entry written from the workers' shares (in a worker: the keys of every record and
    the slices of the shards are built there, not in the training process)."""
    assert _JOB is not None
    shares = []
    for path in share_paths:
        with open(path, "rb") as f:
            shares.append(pickle.load(f))
    failures = [s.failure for s in shares if s.failure is not None]
    if failures:
        raise DataValidationError(min(failures)[1])
    report = _merged_report(shares, _JOB.new_report())
    keys = _keys_in_file_order(shares, report, max_examples)
    _write_entry(shares, keys, report, arrow_path, report_path)
    return report


def read_in_parallel(job: ReadJob, arrow_path: str, report_path: str, max_examples: int) -> ValidationReport:
    """Read the source on ``job.workers`` forked processes and write its cache entry.

    Raises:
        DataValidationError: strict mode and a problem (the first in the file), or what a
            worker's reading raised (a broken JSON list).
    """
    global _JOB
    _JOB = job
    try:
        with multiprocessing.get_context("fork").Pool(job.workers) as pool:
            share_paths = pool.map(_forked_share, range(job.workers))
            return pool.apply(_forked_entry, (share_paths, arrow_path, report_path, max_examples))
    finally:
        _JOB = None
        for name in glob.glob(glob.escape(job.shard_base) + ".part*"):
            os.remove(name)


def _keys_in_file_order(shares: list[_Share], report: ValidationReport, max_examples: int) -> Any:
    """Every kept record's key (an Arrow array), in file order, and the report's repeated ids."""
    positions = np.concatenate([s.positions for s in shares])
    contents = np.concatenate([s.contents for s in shares])
    order = np.argsort(positions, kind="stable")
    ids = pa.concat_arrays([s.ids for s in shares]).take(pa.array(order))
    keys, repeated, exact, examples = keys_in_file_order(ids, contents[order], positions[order], max_examples)
    report.add_repeats(repeated, exact, examples)
    return keys


def _write_entry(shares: list[_Share], keys: Any, report: ValidationReport, arrow_path: str,
                 report_path: str) -> None:
    """The shards' rows block by block in file order, with their keys, as one entry."""
    from datasets import Dataset

    tables = [Dataset.from_file(s.shard).data.table for s in shares]
    taken = [0] * len(shares)
    last = max((max(s.rows_per_block, default=-1) for s in shares), default=-1)
    writer = CacheWriter(arrow_path, report_path)
    try:
        done = 0
        column = tables[0].schema.get_field_index("key")
        for block in range(last + 1):
            worker = block % len(shares)
            rows = shares[worker].rows_per_block.get(block, 0)
            if not rows:
                continue
            piece = tables[worker].slice(taken[worker], rows)
            taken[worker] += rows
            piece = piece.set_column(column, "key", keys.slice(done, rows))
            done += rows
            writer.add_table(piece)
        writer.commit(report.to_dict())
    except BaseException:
        writer.abort()
        raise
