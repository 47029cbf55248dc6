"""Record checks, the per-source validation report, and the strict-mode error.

Every problem a reader can meet has a code in :data:`PROBLEMS` with a one-line
description and how to fix it. In ``skip`` mode a record with any problem is left out
and counted under its first problem's code (so the skipped counts add up exactly to
``records_read - records_kept``); every problem class it shows is also counted, with a
few example ids. In ``strict`` mode the first problem raises
:class:`DataValidationError` naming the file, record id, turn and the fix. Turns are
numbered as everywhere in mmtune: the 1-based question/answer exchange and its side
(``turn 2 (answer)``), so a problem found here is the turn the viewer shows.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from mmtune.core.dialogue import ROLES, Dialogue, Image, turn_label

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.core.images import ImageLimits

# code -> (what is wrong, how to fix it)
PROBLEMS: dict[str, tuple[str, str]] = {
    "invalid_json": (
        "line is not valid JSON",
        "repair or delete the line (each JSONL line must be one JSON object)",
    ),
    "non_utf8": (
        "text is not valid UTF-8",
        "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)",
    ),
    "lone_surrogate": (
        "text holds an escape such as \\ud800 that is half of a UTF-16 surrogate pair, which is no character",
        "write the character itself, or its full pair (\\ud83d\\ude00 is one emoji), or delete the escape",
    ),
    "record_too_large": (
        "record (a JSONL line) is longer than data.validation.max_record_bytes; it was skipped unread",
        "split or shorten the record, or raise data.validation.max_record_bytes if such records are expected",
    ),
    "unreadable_shard": (
        "a shard of the input (Parquet / Arrow file) cannot be opened or read; counted as one skipped record",
        "download the shard again (its name is given), or remove it from the folder or glob",
    ),
    "too_deep": (
        "record nests lists/objects deeper than the JSON parser can follow",
        "flatten or delete the record: no supported format nests more than a few levels",
    ),
    "malformed_record": (
        "record does not have the format's fields/types",
        "give the record the fields its format requires (see docs/data.md)",
    ),
    "placeholder_mismatch": (
        "number of image placeholders differs from the number of images",
        "make the count of placeholders in the text equal the length of the record's image list",
    ),
    "placeholder_in_assistant": (
        "image placeholder inside an assistant turn",
        "move the image to a user turn; assistant turns must be text only",
    ),
    "missing_image": (
        "image file does not exist",
        "check source.image_root / strip_image_prefix, or restore the file",
    ),
    "invalid_image_path": (
        "image path holds a character no file name can (a NUL byte)",
        "correct the path in the data file",
    ),
    "path_outside_root": (
        "image path points outside the image root (through '..', a symlink or an absolute path)",
        "keep images under source.image_root, or set data.allow_absolute_image_paths=true for real absolute paths",
    ),
    "corrupt_image": (
        "image file cannot be opened as an image",
        "replace the file with a valid image (or set validation.check_images=exists to skip the check)",
    ),
    "image_too_large": (
        "image's size, area or aspect ratio (from its header) is above model.image_limits; it is not decoded",
        "crop or downscale the image, or raise model.image_limits.max_side / max_pixels / max_aspect_ratio",
    ),
    "empty_conversation": (
        "conversation has no user/assistant turns",
        "drop the record or add its turns",
    ),
    "empty_turn": (
        "turn has no text and no image",
        "fill in the turn's text or remove the user/assistant pair",
    ),
    "unknown_role": (
        "turn has a role the format does not define",
        "use user/human and assistant/gpt/bot (or system first)",
    ),
    "role_order": (
        "turns do not alternate user, assistant (optional system first, ends with assistant)",
        "fix the order: start with user, alternate, end with an assistant answer",
    ),
    "text_too_long": (
        "text is longer than data.validation.max_turn_chars (one turn) or max_record_chars (the whole record); "
        "it was left out before tokenising",
        "split the dialogue or shorten the text (the training window keeps a few thousand tokens of it at most), or "
        "raise data.validation.max_turn_chars / max_record_chars if such texts are meant",
    ),
    "field_too_long": (
        "record id, role or image path is longer than any real one (id and role 1024, path 4096 characters)",
        "correct the field in the data file",
    ),
    "duplicate_id": (
        "record id already used by an earlier record in this file (an evaluation file: results are joined by id)",
        "give every record of an evaluation file a unique id (the first occurrence is kept)",
    ),
}


#: the longest record id and role (characters) a record may have: they are repeated in every report and log
MAX_ID_CHARS = 1024
#: the longest image path (characters): PATH_MAX on Linux
MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class TextLimits:
    """How much text one turn and one record may hold (``data.validation.max_turn_chars`` /
    ``max_record_chars``), checked on the converted dialogue before anything tokenises it, so
    that what tokenising costs does not depend on one record."""

    max_turn_chars: int = 262_144
    max_record_chars: int = 1_048_576

    @classmethod
    def of(cls, validation: Any) -> "TextLimits":
        """The limits a ``data.validation`` section sets."""
        return cls(validation.max_turn_chars, validation.max_record_chars)


def _clipped(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class DataValidationError(ValueError):
    """A data file has a problem and validation mode is strict (or the file is unreadable)."""


@dataclass(frozen=True)
class Problem:
    """One problem found in one record."""

    code: str
    record_id: str
    record_index: int
    """Position of the record in the file (0-based; JSONL: line number - 1)."""
    turn_index: int | None = None
    """Position of the message in the record's turn list (0-based), where the problem is."""
    detail: str = ""
    system_first: bool = False
    """The record's first message is a system message (it is no part of any exchange)."""

    def turn(self) -> str:
        """Where in the dialogue, as every report and the viewer number it: the 1-based
        question/answer exchange and its side (``turn 2 (answer)``), or ``system message``;
        ``""`` for a problem of the whole record."""
        return turn_label(self.turn_index, self.system_first)

    def message(self, file: str) -> str:
        what, fix = PROBLEMS[self.code]
        where = f"{file}: record {self.record_id!r} (#{self.record_index})"
        if self.turn_index is not None:
            where += f", {self.turn()}"
        detail = f" ({self.detail})" if self.detail else ""
        return f"{where}: [{self.code}] {what}{detail}. How to fix: {fix}."


@dataclass
class ValidationReport:
    """Counts and problems of one source, after reading and validating it."""

    source: str
    path: str
    format: str
    check_images: str = "verify"
    max_examples: int = 5
    records_read: int = 0
    records_kept: int = 0
    turns: int = 0
    images: int = 0
    text_only: int = 0
    problems: dict[str, int] = field(default_factory=dict)
    """Records affected per problem class (a record may count under several)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Skipped records per reason: the record's first problem. Sums to records_skipped."""
    examples: dict[str, list[str]] = field(default_factory=dict)
    """Up to ``max_examples`` example locations per problem class."""
    first_problem: str | None = None
    """Full message of the first problem met; what strict mode raises with."""
    repeated_ids: int = 0
    """Kept records whose id an earlier kept record of the source has (information: each is
    trained, under its own key, see :mod:`mmtune.data.keys`)."""
    exact_duplicates: int = 0
    """Records equal to an earlier one (same id, images and conversation): kept among
    :attr:`repeated_ids`, or dropped (:attr:`duplicates_dropped`)."""
    duplicates_dropped: int = 0
    """Exact duplicates left out (``data.validation.drop_exact_duplicates``); not skipped records."""
    repeat_examples: list[str] = field(default_factory=list)
    """Up to ``max_examples`` repeated ids with the positions of two of their records."""

    @property
    def records_skipped(self) -> int:
        """Records left out for a problem (exact duplicates dropped on request are not problems)."""
        return self.records_read - self.records_kept - self.duplicates_dropped

    def add_repeats(self, repeated: int, exact: int, examples: list[str]) -> None:
        """Record what :class:`~mmtune.data.keys.RecordKeys` found over the source: ``repeated``
        records repeating an earlier id, ``exact`` of them exact duplicates (the dropped ones
        included: :attr:`repeated_ids` counts the kept records)."""
        self.repeated_ids = repeated - self.duplicates_dropped
        self.exact_duplicates = exact
        self.repeat_examples = list(examples)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add_kept(self, dialogue: Dialogue) -> None:
        self.records_read += 1
        self.records_kept += 1
        self.turns += len(dialogue.turns)
        n = dialogue.num_images
        self.images += n
        self.text_only += n == 0

    def add_dropped(self) -> None:
        """Count one exact duplicate left out on request (``data.validation.drop_exact_duplicates``)."""
        self.records_read += 1
        self.duplicates_dropped += 1

    def add_skipped(self, problems: list[Problem]) -> None:
        """Count one record left out because of ``problems`` (non-empty)."""
        self.records_read += 1
        self.skipped[problems[0].code] = self.skipped.get(problems[0].code, 0) + 1
        for code in dict.fromkeys(p.code for p in problems):
            self.problems[code] = self.problems.get(code, 0) + 1
            examples = self.examples.setdefault(code, [])
            if len(examples) < self.max_examples:
                p = next(p for p in problems if p.code == code)
                turn = f" {p.turn()}" if p.turn_index is not None else ""
                detail = f": {p.detail}" if p.detail else ""
                examples.append(f"{p.record_id}{turn}{detail}")
        if self.first_problem is None:
            self.first_problem = problems[0].message(self.path)

    def _render_repeats(self) -> list[str]:
        """The information lines on repeated ids (no problem: every such record is trained)."""
        if not (self.repeated_ids or self.duplicates_dropped):
            return []
        lines = [f"  ids      {self.repeated_ids} kept record(s) repeat an earlier record's id; each is trained "
                 "(as LLaVA trains them), under its own key id@position"]
        if self.exact_duplicates or self.duplicates_dropped:
            if self.duplicates_dropped:
                lines.append(f"           {self.duplicates_dropped} exact duplicate(s) (same id, images and "
                             "conversation) dropped by data.validation.drop_exact_duplicates")
            else:
                lines.append(f"           {self.exact_duplicates} of them exact duplicate(s) (same id, images and "
                             "conversation), kept; data.validation.drop_exact_duplicates=true drops them")
        lines += [f"           e.g. {ex}" for ex in self.repeat_examples]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ValidationReport":
        return cls(**d)

    def render(self) -> str:
        lines = [
            f"source {self.source} (format {self.format}, images checked: {self.check_images})",
            f"  file     {self.path}",
            f"  records  read {self.records_read}, kept {self.records_kept}, skipped {self.records_skipped}"
            + (f", exact duplicates dropped {self.duplicates_dropped}" if self.duplicates_dropped else ""),
            f"  kept     turns {self.turns}, images {self.images}, text-only records {self.text_only}",
        ]
        lines += self._render_repeats()
        if self.skipped:
            reasons = ", ".join(f"{code} {n}" for code, n in sorted(self.skipped.items(), key=lambda kv: -kv[1]))
            lines.append(f"  skipped  by first problem: {reasons}")
        if self.problems:
            lines.append("  problems (records affected; a record can show several):")
            for code, n in sorted(self.problems.items(), key=lambda kv: -kv[1]):
                what, fix = PROBLEMS[code]
                lines.append(f"    {code:<24} {n:>8}  {what}")
                lines.append(f"    {'':<24} {'':>8}  fix: {fix}")
                for ex in self.examples.get(code, []):
                    lines.append(f"    {'':<24} {'':>8}  e.g. {ex}")
        else:
            lines.append("  problems none")
        return "\n".join(lines)


class ImageChecker:
    """Checks image files once per path (datasets repeat images across records).

    ``verify`` opens the file with PIL and runs ``Image.verify()``: the header is parsed
    and structure checked without decoding pixels, so it costs well under a millisecond
    for small files, but a file cut short after its header passes. ``decode`` decodes
    every pixel as training will (milliseconds per image), so nothing found later can
    fail. ``exists`` only stats the file; ``none`` checks nothing. ``verify`` and
    ``decode`` also hold the header's size against ``limits`` (``model.image_limits``)
    first: a refused image is ``image_too_large`` and is never decoded.
    """

    def __init__(self, level: str = "verify", limits: "ImageLimits | None" = None):
        from mmtune.core.images import ImageLimits

        self.level = level
        self.limits = limits or ImageLimits()
        self._seen: dict[str, tuple[str, str] | None] = {}

    def check(self, path: str) -> tuple[str, str] | None:
        """``None`` if fine, else ``(problem_code, detail)``."""
        if self.level == "none":
            return None
        if path in self._seen:
            return self._seen[path]
        result: tuple[str, str] | None = None
        if not os.path.isfile(path):
            result = ("missing_image", path)
        elif self.level in ("verify", "decode"):
            from PIL import Image as PILImage

            from mmtune.core.images import ImageTooLargeError

            try:
                self.limits.check_file(path)
                with PILImage.open(path) as im:
                    if self.level == "decode":
                        im.load()
                    else:
                        im.verify()
            except ImageTooLargeError as e:
                result = ("image_too_large", f"{path}: {e.reason}")
            except Exception as e:  # PIL raises many types for bad files; all mean "corrupt"
                result = ("corrupt_image", f"{path}: {type(e).__name__}: {e}")
        self._seen[path] = result
        return result


def _size_problems(dialogue: Dialogue, limits: TextLimits, add: Any) -> bool:
    """Add ``text_too_long`` / ``field_too_long`` problems; whether any was found (the other checks are then skipped:
    they would repeat the oversized field in their details)."""
    found = len(dialogue.id) > MAX_ID_CHARS
    if found:
        add("field_too_long", None, f"id of {len(dialogue.id)} characters")
    total = 0
    for t, turn in enumerate(dialogue.turns):
        if len(turn.role) > MAX_ID_CHARS:
            add("field_too_long", t, f"role of {len(turn.role)} characters")
            found = True
        chars = 0
        for seg in turn.segments:
            if isinstance(seg, str):
                chars += len(seg)
            elif len(seg.path) > MAX_PATH_CHARS:
                add("field_too_long", t, f"image path of {len(seg.path)} characters")
                found = True
        total += chars
        if chars > limits.max_turn_chars:
            add("text_too_long", t, f"{chars} characters, above data.validation.max_turn_chars={limits.max_turn_chars}")
            found = True
    if total > limits.max_record_chars and not found:
        add("text_too_long", None, f"{total} characters in all, above data.validation.max_record_chars="
                                   f"{limits.max_record_chars}")
        found = True
    return found


def check_dialogue(
    dialogue: Dialogue, record_index: int, images: ImageChecker | None = None,
    text_limits: TextLimits | None = None,
) -> list[Problem]:
    """Format-independent checks of a converted dialogue; returns every problem found.

    Roles the reader could not map are kept verbatim in the turn so they can be reported
    here as ``unknown_role``. Text above ``text_limits`` (default :class:`TextLimits`) and an
    id, role or image path longer than any real one are problems of their own, found first.
    """
    rid = _clipped(dialogue.id) if len(dialogue.id) > MAX_ID_CHARS else dialogue.id
    problems: list[Problem] = []

    turns = dialogue.turns
    body_start = 1 if turns and turns[0].role == "system" else 0

    def add(code: str, turn: int | None, detail: str = "") -> None:
        problems.append(Problem(code, rid, record_index, turn, detail, system_first=bool(body_start)))

    if _size_problems(dialogue, text_limits or TextLimits(), add):
        return problems
    if len(turns) - body_start == 0:
        add("empty_conversation", None, f"{len(turns)} turns")
        return problems
    check_files = images is not None and images.level != "none"
    for t, turn in enumerate(turns):
        if turn.role not in ROLES:
            add("unknown_role", t, f"role {turn.role!r}")
        # One pass over the segments: this runs for every record of 600k-record files.
        n_images, has_text = 0, False
        for seg in turn.segments:
            if isinstance(seg, str):
                has_text = has_text or (bool(seg) and not seg.isspace())
            else:
                n_images += 1
        if not n_images and not has_text:
            add("empty_turn", t, f"{turn.role} turn is empty")
        if turn.role == "assistant" and n_images:
            add("placeholder_in_assistant", t, f"{n_images} image(s)")
        if turn.role == "system" and t != 0:
            add("role_order", t, "system turn after the start")
    expected = "user"
    for t in range(body_start, len(turns)):
        role = turns[t].role
        if role in ("user", "assistant") and role != expected:
            if t == body_start:
                add("role_order", t, "starts with assistant")
            else:
                add("role_order", t, f"two {role} turns in a row")
            break
        expected = "assistant" if expected == "user" else "user"
    else:
        if turns[-1].role == "user":
            add("role_order", len(turns) - 1, "ends with a user turn (no answer)")
    if check_files:
        for t, turn in enumerate(turns):
            for seg in turn.segments:
                if isinstance(seg, Image):
                    bad = images.check(seg.path)
                    if bad is not None:
                        add(bad[0], t, bad[1])
    return problems


def format_reports(reports: Iterable[ValidationReport]) -> str:
    """All sources' reports plus a total line."""
    reports = list(reports)
    parts = [r.render() for r in reports]
    read = sum(r.records_read for r in reports)
    kept = sum(r.records_kept for r in reports)
    skipped = sum(r.records_skipped for r in reports)
    dropped = sum(r.duplicates_dropped for r in reports)
    parts.append(f"total: {len(reports)} source(s), records read {read}, kept {kept}, skipped {skipped}"
                 + (f", exact duplicates dropped {dropped}" if dropped else ""))
    return "\n\n".join(parts)


__all__ = [
    "PROBLEMS",
    "DataValidationError",
    "Problem",
    "turn_label",
    "ValidationReport",
    "ImageChecker",
    "MAX_ID_CHARS",
    "MAX_PATH_CHARS",
    "TextLimits",
    "check_dialogue",
    "format_reports",
]
