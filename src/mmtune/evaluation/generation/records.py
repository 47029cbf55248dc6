"""The generations file: one JSON line per answered turn, appended as produced, resumable.

Every generation backend (the local model, a served model) writes the same file,
``generations/<benchmark>.jsonl``, through :class:`GenerationsFile`:

* each :class:`TurnRecord` is appended and flushed as soon as it exists, so a crash
  loses at most the turns in flight; a torn last line is cut on the next open;
* one writer per file: ``.<file>.lock`` beside it is locked while the file is open
  (:func:`mmtune.io.locks.lock_directory`), so a second process answering into the same
  file is refused, naming the holder, instead of appending to it;
* ``<file>.settings.json`` keys the answers on what they depend on (decoding, weights or
  served model, data file); a file written with other settings is refused
  (:class:`StaleGenerationsError`, naming the run that wrote it), also while it holds no
  answer yet (its writer may be at its first one), and every resumed record's question
  must equal the one asked now. Secrets are redacted from the settings as stored;
* finished turns are not asked again; a failed turn (served models only: its call
  failed, ``finish_reason: "error"``, or its answer was empty, null or not text; either
  way its record has an ``error``) is asked again on the next run;
* read-only ``resume_from`` files (other ranks' shares of a data-parallel run, or a
  previous run's shares) count as finished turns too, after the same checks;
* when a run ends, :meth:`GenerationsFile.finish` rewrites the file in dialogue and turn
  order, so the file does not depend on the batch size, the batch schedule, the
  concurrency or the number of ranks that produced it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.data.dialogue import Dialogue, Turn
from mmtune.io.nofollow import open_output, write_output_text

__all__ = ["TurnRecord", "StaleGenerationsError", "GenerationFailures", "GenerationsFile", "question_text", "is_failed",
           "read_generations", "record_line", "settings_path", "lock_path", "write_lines", "check_failed_turns"]

FAILED = "error"
"""``finish_reason`` of a turn whose call failed: it has no answer and is asked again on resume."""


def is_failed(row: dict[str, Any]) -> bool:
    """Whether a stored record has no usable answer: its call failed, or what came back was
    empty, null or not text (it carries an ``error``). Such a turn is asked again on resume."""
    return row.get("finish_reason") == FAILED or bool(row.get("error"))


class StaleGenerationsError(ValueError):
    """A generation file holds answers of another model, data file, prompt or decoding."""

    def __init__(self, path: Path, message: str):
        self.path = path
        super().__init__(message)


class GenerationFailures(RuntimeError):
    """Too many turns failed at a served model: the scores would mix real zeros with failures."""


@dataclass
class TurnRecord:
    """One answered (or skipped) turn, as written to the generation JSONL."""

    dialogue_id: str
    turn: int
    """Exchange index within the dialogue (0 = first question)."""
    question: str
    answer: Optional[str]
    """``None`` when the turn was skipped because the dialogue no longer fits, or its call failed."""
    reference: Optional[str]
    prompt_tokens: int
    """Length of the full prompt of this turn (history + question + generation prompt)."""
    forward_tokens: int
    """Tokens run through the model for this turn (fed prompt tokens + decoding steps)."""
    new_tokens: int
    finish_reason: str
    """``stop`` (a stop token), ``length`` (max_new_tokens or window end), ``context``
    (skipped) or ``error`` (a served model's call failed; asked again on resume)."""
    context: Optional[dict[str, Any]] = None
    """Overflow handling applied to this turn: policy, dropped exchanges, carried images."""
    error: Optional[dict[str, Any]] = None
    """A served model's failure of this turn: ``{"status", "message", "cause", "kind"}``
    (key redacted), also set for an answer that is empty, null or not text; ``kind`` is the
    class (``http_status``, ``timeout``, ``connection``, ``malformed``, ``too_large``,
    ``compressed``, ``empty``, ``null``, ``not_text``, ``image``, ``not_asked``). Left out of
    the file when ``None``."""


def question_text(turn: Turn) -> str:
    """A user turn as text, images shown as ``<image>`` where they stood: the ``question`` of
    a :class:`TurnRecord` (checked on resume) and of a judge prompt."""
    return "".join(s if isinstance(s, str) else "<image>" for s in turn.segments).strip()


def record_line(record: TurnRecord) -> str:
    """The JSON line of ``record`` (no newline); ``error`` only when set."""
    row = asdict(record)
    if row["error"] is None:
        del row["error"]
    return json.dumps(row, ensure_ascii=False)


def read_generations(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a generation JSONL; a torn last line (crash mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def settings_path(path: Path) -> Path:
    """``<name>.settings.json`` beside ``<name>.jsonl``."""
    return Path(path).with_suffix(".settings.json")


def lock_path(path: Path) -> Path:
    """``.<name>.jsonl.lock`` beside ``<name>.jsonl``: the lock its writer holds."""
    return Path(path).with_name(f".{Path(path).name}.lock")


def _key(row: dict[str, Any]) -> tuple[str, int]:
    return row["dialogue_id"], int(row["turn"])


class GenerationsFile:
    """One benchmark's generations file while a generator answers into it.

    Args:
        path: the JSONL file (created with its folder when missing).
        settings: what the answers depend on; compared with ``<path>.settings.json``
            (its ``about`` entry describes the run for messages and is not compared).
        dialogues: the dialogues being answered (resumed questions are checked against them).
        resume_from: further files whose finished turns count as done (read, never written).

    Raises:
        StaleGenerationsError: ``path`` or a ``resume_from`` file holds answers of another
            run, or of other questions, or was started by another run.
        DirectoryLockedError: another process is writing ``path``.
    """

    def __init__(self, path: str | os.PathLike, settings: dict[str, Any], dialogues: Sequence[Dialogue], *,
                 resume_from: Sequence[str | os.PathLike] = ()):
        from mmtune.io.locks import lock_directory
        from mmtune.io.secrets import redact

        self.path = Path(path)
        self._lock = lock_directory(self.path.parent, purpose=f"generation of {self.path.name}",
                                    name=lock_path(self.path).name,
                                    hint="give this evaluation another output folder (each checkpoint gets its own "
                                         "by default)")
        try:
            self.records: dict[tuple[str, int], dict[str, Any]] = {}
            """Every record read or written, the latest per (dialogue, turn)."""
            settings = json.loads(json.dumps(redact(settings), default=str))  # as stored
            sources = [Path(p) for p in resume_from if Path(p).exists()]
            for source in sources:
                _check_settings(source, settings)
            _check_settings(self.path, settings)
            _drop_torn_line(self.path)
            for source in [*sources, self.path]:
                latest: dict[tuple[str, int], dict[str, Any]] = {}
                for row in read_generations(source):
                    latest[_key(row)] = row  # within a file, a later record replaces an earlier one
                for key, row in latest.items():
                    # across files (ranks' shares), an answer beats another file's failure
                    if not is_failed(row) or key not in self.records:
                        self.records[key] = row
            _check_questions(self.path, self.done, dialogues)
            write_output_text(settings_path(self.path), json.dumps(settings, indent=2, default=str))
            self._handle = open_output(self.path, "a")
        except BaseException:
            self._lock.release()
            raise

    @property
    def done(self) -> dict[tuple[str, int], dict[str, Any]]:
        """Finished turns: every record but failed ones (:func:`is_failed`)."""
        return {k: r for k, r in self.records.items() if not is_failed(r)}

    def append(self, record: TurnRecord) -> None:
        line = record_line(record)
        self.records[(record.dialogue_id, record.turn)] = json.loads(line)
        self._handle.write(line + "\n")
        self._handle.flush()  # a crash loses at most the turn in flight

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()
        self._lock.release()  # idempotent

    def finish(self, order: Sequence[tuple[str, int]]) -> None:
        """Close the file and rewrite it in ``order`` (dialogue and turn order), the latest
        record per turn; records of turns not in ``order`` (other dialogues) follow in
        their file order. Atomic: a crash leaves the old file or the new one."""
        if not self._handle.closed:
            self._handle.close()
        keys = set(order)
        rows = [self.records[k] for k in order if k in self.records]
        rows += [r for k, r in self.records.items() if k not in keys]
        try:
            write_lines(self.path, [json.dumps(r, ensure_ascii=False) for r in rows])
        finally:
            self._lock.release()


def write_lines(path: Path, lines: Sequence[str]) -> None:
    """Write ``lines`` as the JSONL file ``path`` at once (a temporary file, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open_output(tmp, "w") as handle:
        for line in lines:
            handle.write(line + "\n")
    os.replace(tmp, path)


def _check_settings(path: Path, settings: dict[str, Any]) -> None:
    # Resuming another model's, data file's or decoding's answers would mix two
    # evaluations in one file and report them under the new name.
    # An empty file is checked too: the run that started it may be writing its first answer.
    meta = settings_path(path)
    if meta.exists() and path.exists():
        old = json.loads(meta.read_text())
        diff = {k: (old.get(k), v) for k, v in settings.items() if k != "about" and old.get(k) != v}
        if diff:
            about = old.get("about") or {}
            who = ", ".join(f"{k} {v!r}" for k, v in about.items()) or "no run recorded"
            held = "holds answers generated" if path.stat().st_size else "was started (no answer yet)"
            raise StaleGenerationsError(
                path,
                f"{path} {held} with other settings by another run ({who}); they "
                f"differ in {sorted(diff)}: "
                f"{diff} (old, new). Not mixing them: use another output folder (each checkpoint gets its own "
                f"by default) or delete {path.name} and {meta.name} to start over",
            )


def _check_questions(out_path: Path, done: dict[tuple[str, int], dict[str, Any]], dialogues: Sequence[Dialogue]) -> None:
    """Resumed records must answer the questions being asked now (same data, same prompts)."""
    for dialogue in dialogues:
        for t, (u, _) in enumerate(dialogue.exchanges()):
            old = done.get((dialogue.id, t))
            if old is not None and old.get("question") != question_text(dialogue.turns[u]):
                raise StaleGenerationsError(
                    out_path,
                    f"{out_path}: the stored answer of dialogue {dialogue.id!r}, turn {t} was generated for another "
                    f"question ({old.get('question')!r:.80} vs now {question_text(dialogue.turns[u])!r:.80}): the data "
                    "file or prompt changed. Use another output folder or delete the file to start over",
                )


def _drop_torn_line(path: Path) -> None:
    """Cut a half-written last line so appended records start on a line of their own."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with path.open("r+b") as handle:
            handle.truncate(cut)


def check_failed_turns(records: Sequence[TurnRecord], max_failed_share: float, *, benchmark: str) -> None:
    """Raise :class:`GenerationFailures` when more than ``max_failed_share`` of ``records``
    carry an ``error`` (a failed call or an empty answer).

    Called after the benchmark's results and details are written, so nothing paid for is lost.
    """
    failed = [r for r in records if r.error]
    if not failed or len(failed) / len(records) <= max_failed_share:
        return
    first = failed[0]
    status = f"HTTP {first.error['status']}: " if first.error.get("status") else ""
    raise GenerationFailures(
        f"{benchmark}: {len(failed)} of {len(records)} turns have no usable answer from the served model "
        f"(allowed: {100 * max_failed_share:g}%): {sum(r.answer is None for r in failed)} failed after retries, "
        f"{sum(r.answer is not None for r in failed)} empty or not text. These scores are not a measure of the "
        "model.\n"
        f"  first: dialogue {first.dialogue_id!r}, turn {first.turn}: {status}{first.error.get('message')}\n"
        f"  likely cause: {first.error.get('cause') or 'see the message'}\n"
        "Results and per-turn errors are written (generations file, `error` field); fix the cause and re-run: "
        "answered turns are kept, failed ones are asked again. Raise eval.generation.api.max_failed_share to "
        "accept some failures."
    )
