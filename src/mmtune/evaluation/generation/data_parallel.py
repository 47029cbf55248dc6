"""Data-parallel generation: every process answers its share of the dialogues; the shares become one file.

Launched with several processes (``torchrun`` or ``accelerate launch recipes/evaluate.py``,
``mmtune evaluate checkpoint ... --processes N``, or the evaluations of a DDP / ZeRO-1/2
training run), each rank holds the whole model on its own device and:

1. **splits** the benchmark's dialogues with every other rank, the same way on every rank
   (no communication): balanced by expected tokens (:func:`split_by_tokens`, longest
   first, each to the least loaded rank), a dialogue's expected tokens being its encoded
   length with the reference answers standing in for the model's
   (:meth:`~mmtune.evaluation.generation.generator.DialogueGenerator.expected_tokens`);
2. **answers** its share on the batched KV path into its own file,
   ``generations/<name>.rank<r>-of-<n>.jsonl``, a generations file like any other: killed,
   it resumes from there when relaunched with the same process count. Each rank also
   reads the merged file and the shares of a launch with another process count as
   finished turns, so changing the count loses nothing;
3. **gathers**: every rank sends whether it succeeded (its error if not) and its records
   to every other (one all-gather). If a rank failed, every rank raises that rank's error
   and nothing is merged, so no partial file is ever reported as complete. Otherwise
   rank 0 writes ``generations/<name>.jsonl`` in dialogue and turn order (the file a
   one-process run writes) with its settings file, and removes the shares.

Scoring and judging then run once, on rank 0, after every benchmark is generated
(:func:`mmtune.evaluation.runner.run_benchmarks`), so no answer is judged twice and the
other ranks do not wait through judging between benchmarks.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from mmtune.evaluation.generation.records import (
    StaleGenerationsError,
    TurnRecord,
    lock_path,
    record_line,
    settings_path,
    write_lines,
)
from mmtune.io.nofollow import write_output_text

__all__ = ["Layout", "RankFailed", "current_layout", "split_by_tokens", "shard_path", "shard_files", "generate_shared",
           "check_layout", "rank_device", "lock_run_folder", "close_layout"]


class RankFailed(RuntimeError):
    """A rank of a data-parallel evaluation failed; every rank raises it, nothing is merged."""

    def __init__(self, rank: int, message: str):
        self.rank = rank
        super().__init__(message)


def _one(obj: Any) -> list[Any]:
    return [obj]


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Layout:
    """Where this process stands in a data-parallel evaluation."""

    rank: int = 0
    world_size: int = 1
    device: Optional[str] = None
    """This rank's device (``cuda:<local rank>``) when several processes share a machine."""
    exchange: Callable[[Any], list[Any]] = _one
    """All-gather: one picklable object from every rank, in rank order, on every rank."""
    barrier: Callable[[], None] = _nothing

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def current_layout() -> Layout:
    """The layout of this process: one process unless launched with several (``WORLD_SIZE``
    > 1, as ``torchrun`` and ``accelerate launch`` set it).

    Several processes join (or reuse, in a training run) accelerate's process group: NCCL
    with one GPU per rank, gloo on CPU.
    """
    import torch

    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 and not initialized:
        return Layout()
    from accelerate import PartialState
    from accelerate.utils import gather_object

    state = PartialState(cpu=not torch.accelerator.is_available())  # a training run's state when it has one
    if state.num_processes <= 1:
        return Layout()
    device = str(state.device) if state.device.type != "cpu" else None
    return Layout(state.process_index, state.num_processes, device,
                  exchange=lambda obj: gather_object([obj]), barrier=state.wait_for_everyone)


def lock_run_folder(directory: str | os.PathLike, layout: Layout, *, purpose: str, hint: str) -> Any:
    """The output folder's lock (:func:`mmtune.io.locks.lock_directory`) for one run of
    ``layout``'s processes: one process takes it; of several, the main one does (the ranks of
    one job share the folder) and every rank learns the outcome, so a refusal stops all of
    them with the holder's details instead of leaving the others waiting at a gather.

    Returns:
        A context manager releasing the lock (a no-op on the other ranks).

    Raises:
        DirectoryLockedError: another process holds the folder (on every rank).
    """
    import contextlib

    from mmtune.io.locks import DirectoryLockedError, lock_directory

    if not layout.distributed:
        return lock_directory(directory, purpose=purpose, hint=hint)
    lock, refusal = None, None
    if layout.is_main:
        try:
            lock = lock_directory(directory, purpose=f"{purpose} ({layout.world_size} processes)", hint=hint)
        except DirectoryLockedError as err:
            refusal = (str(err), err.holder)
    outcome = layout.exchange(refusal)[0]
    if outcome is not None:
        raise DirectoryLockedError(*outcome)
    return lock if lock is not None else contextlib.nullcontext()


def close_layout(layout: Layout) -> None:
    """End a data-parallel run this process launched (the evaluate command and recipe call
    it once the run succeeded): every rank waits for the others, the process group goes,
    and what gloo's work objects held is freed now; freed in interpreter shutdown instead,
    it can abort a rank whose run succeeded (SIGABRT, "terminate called without an active
    exception"). Nothing for one process."""
    import gc

    import torch

    if not layout.distributed:
        return
    layout.barrier()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()


def rank_device(device: str, layout: Layout) -> str:
    """``eval.generation.device`` for this rank: ``auto`` is the rank's own GPU when several share a machine."""
    return layout.device if device == "auto" and layout.device else device


def check_layout(generation: Any, layout: Layout) -> list[str]:
    """Problems of running ``generation`` (``eval.generation``) on ``layout``."""
    if layout.distributed and generation.backend != "local":
        return [f"eval.generation.backend={generation.backend!r} answers with a served model in one process "
                f"(eval.generation.api.concurrency requests at once), but this evaluation was launched with "
                f"{layout.world_size} processes: launch it once (without torchrun / --processes)"]
    return []


def split_by_tokens(weights: Sequence[int], world_size: int) -> list[list[int]]:
    """Deal item indices to ``world_size`` ranks so their summed ``weights`` are balanced.

    Longest processing time first: items in decreasing weight (ties by index), each to the
    rank with the least weight so far (ties to the lower rank), which is within 4/3 of the
    best possible largest share. Deterministic, so every rank computes the same split.

    Returns:
        Per rank, its item indices in increasing order.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1")
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += weights[i]
    return [sorted(s) for s in shares]


def shard_path(path: Path, rank: int, world_size: int) -> Path:
    """``<name>.rank<r>-of-<n>.jsonl`` beside ``<name>.jsonl``."""
    return path.with_name(f"{path.stem}.rank{rank}-of-{world_size}{path.suffix}")


def shard_files(path: Path) -> list[Path]:
    """Every rank's share of ``path`` left in its folder (any process count), in name order."""
    pattern = re.compile(re.escape(path.stem) + r"\.rank\d+-of-\d+" + re.escape(path.suffix) + "$")
    return sorted(p for p in path.parent.glob(f"{path.stem}.rank*-of-*{path.suffix}") if pattern.fullmatch(p.name))


def _remove(paths: Sequence[Path]) -> None:
    """Delete merged shares with their settings and lock files (no writer holds them any more)."""
    for p in paths:
        for f in (p, settings_path(p), lock_path(p)):
            if f.exists():
                f.unlink()


def generate_shared(generator: Any, dialogues: Sequence[Any], out_path: str | os.PathLike, *, layout: Layout,
                    progress: bool = False, run_key: Optional[dict[str, Any]] = None
                    ) -> tuple[list[TurnRecord], Optional[list[dict[str, Any]]]]:
    """Answer ``dialogues`` into ``out_path`` with every rank of ``layout`` (see the module docstring).

    One process answers everything into ``out_path`` (taking over the turns of shares an
    earlier data-parallel launch left behind).

    Returns:
        All records in dialogue and turn order (on every rank), and per rank what it did
        (``None`` for one process): dialogues, turns answered, expected tokens, seconds,
        and the generator's counters (forward calls, tokens) for its share.

    Raises:
        RankFailed: a rank failed (the same error on every rank).
        StaleGenerationsError: a rank found answers of another run (on every rank, with
            that rank's file, so the caller can move it aside and retry on all ranks).
    """
    out_path = Path(out_path)
    leftovers = shard_files(out_path)
    if not layout.distributed:
        records = generator.generate(dialogues, out_path=out_path, progress=progress, run_key=run_key,
                                     resume_from=leftovers)
        _remove(leftovers)  # their turns are in out_path now
        return records, None

    weights = [generator.expected_tokens(d) for d in dialogues]
    share = split_by_tokens(weights, layout.world_size)[layout.rank]
    mine = shard_path(out_path, layout.rank, layout.world_size)
    # Shares of this launch's other ranks are being written now and hold none of this
    # rank's dialogues; the merged file and another launch's shares are read as finished turns.
    others = [out_path] + [p for p in leftovers if not p.name.endswith(f"-of-{layout.world_size}{out_path.suffix}")]
    before = dict(generator.stats) if isinstance(getattr(generator, "stats", None), dict) else {}
    started = time.perf_counter()
    report: dict[str, Any] = {"rank": layout.rank, "ok": True}
    try:
        records = generator.generate([dialogues[i] for i in share], out_path=mine, run_key=run_key,
                                     progress=progress and layout.is_main, resume_from=others)
        counters = {k: v - before.get(k, 0) for k, v in getattr(generator, "stats", {}).items()} if before else {}
        report.update(records=[dataclasses.asdict(r) for r in records], work={
            "rank": layout.rank, "dialogues": len(share), "expected_tokens": sum(weights[i] for i in share),
            "turns": counters.get("turns", len(records)), "seconds": round(time.perf_counter() - started, 3),
            **{k: v for k, v in counters.items() if k != "turns"}})
    except Exception as err:  # noqa: BLE001 - every rank must learn of it before anyone waits for this rank
        report.update(ok=False, error=f"{type(err).__name__}: {err}",
                      stale=str(err.path) if isinstance(err, StaleGenerationsError) else None)
    reports = layout.exchange(report)
    failed = [r for r in reports if not r["ok"]]
    if failed:
        first = failed[0]
        if first["stale"]:
            raise StaleGenerationsError(Path(first["stale"]), f"rank {first['rank']}: {first['error']}")
        names = ", ".join(str(r["rank"]) for r in failed)
        raise RankFailed(first["rank"], (
            f"rank {first['rank']} of {layout.world_size} failed while generating {out_path.stem} "
            f"(failed ranks: {names}): {first['error']}\nNo answers were merged into {out_path}; each rank's "
            f"finished turns are kept in {shard_path(out_path, 0, layout.world_size).name.replace('rank0', 'rank*')}: "
            "fix the cause and run the same command again to resume"))
    by_key = {(r["dialogue_id"], int(r["turn"])): r for report in reports for r in report["records"]}
    order = [(d.id, t) for d in dialogues for t in range(len(list(d.exchanges())))]
    rows = [by_key[k] for k in order if k in by_key]
    if layout.is_main:
        write_lines(out_path, [record_line(TurnRecord(**r)) for r in rows])
        write_output_text(settings_path(out_path), settings_path(mine).read_text())
        _remove(shard_files(out_path))
    return [TurnRecord(**r) for r in rows], [r["work"] for r in sorted(reports, key=lambda r: r["rank"])]

