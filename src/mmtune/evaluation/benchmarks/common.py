"""Shared helpers of the benchmarks: MMDU-schema loading, prediction files, prompt filling.

MMDU's ``benchmark.json`` schema (also the synthetic held-out split's) is converted to
:class:`~mmtune.data.dialogue.Dialogue`: user text is split at ``<ImageHere>`` and the
k-th placeholder of the dialogue becomes the k-th path of its ``image`` list.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from mmtune.data.dialogue import Dialogue

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.paths import ResolvedImage
    from mmtune.data.validation import Problem

__all__ = [
    "IMAGE_PLACEHOLDER",
    "load_json_or_jsonl",
    "load_mmdu_dialogues",
    "read_records",
    "refuse",
    "BenchmarkDataError",
    "resolve_image",
    "resolve_image_path",
    "fill_prompt",
    "load_prompt",
    "load_turn_predictions",
]

IMAGE_PLACEHOLDER = "<ImageHere>"
PROMPT_DIR = Path(__file__).parent / "prompts"


def load_json_or_jsonl(path: str | os.PathLike) -> Any:
    """A JSON document, or a list of the objects of a JSON-lines file (by suffix)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: file not found; check the benchmark's data_path / predictions setting")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        out = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}); fix or delete that line") from None
        return out
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None


def resolve_image(path: str, image_root: Optional[str], data_file: Path, *, allow_absolute: bool = False) -> str:
    """The image file of ``path`` by the data layer's rule (:mod:`mmtune.data.paths`):
    joined to ``image_root`` (default: the data file's folder; a leading ``/`` as MMDU
    writes ``/mmdu_pics/x.jpg`` is joined too) and kept inside it.

    Raises:
        ImagePathError: the path escapes the root, is absolute outside it and
            ``allow_absolute`` is off, or holds a NUL byte.
    """
    return resolve_image_path(path, image_root, data_file, allow_absolute=allow_absolute).checked()


def resolve_image_path(path: str, image_root: Optional[str], data_file: Path, *,
                       allow_absolute: bool = False) -> "ResolvedImage":
    """:func:`resolve_image` as a :class:`~mmtune.data.paths.ResolvedImage`, whose ``problem``
    (``path_outside_root``, ``invalid_image_path``) says what is wrong instead of raising."""
    from mmtune.data.paths import ImagePathRules

    return ImagePathRules(image_root or str(Path(data_file).parent), allow_absolute=allow_absolute).resolve(path)


def checked_item_image(path: str, image_root: Optional[str], data_file: Path, checker: Any, *,
                       allow_absolute: bool = False) -> tuple[Optional[str], Optional[str], list[tuple[str, str]]]:
    """An item's image by :func:`resolve_image_path`, then held to ``checker`` (an
    :class:`~mmtune.data.validation.ImageChecker`: exists, opens, within the size limits).

    Returns:
        The resolved file (``None`` when the path itself is refused), the real image root it
        must stay inside when opened (``None``: not confined, see
        :attr:`~mmtune.data.paths.ResolvedImage.root`) and the problems found as
        ``(detail, code)``, for the loader to report against its record.
    """
    resolved = resolve_image_path(path, image_root, data_file, allow_absolute=allow_absolute)
    if resolved.problem:
        return None, None, [(resolved.detail, resolved.problem)]
    found = checker.check(resolved.path)
    return resolved.path, resolved.root, ([] if found is None else [(found[1], found[0])])


class BenchmarkDataError(ValueError):
    """A benchmark file has bad records; the message lists each with file, record, turn and fix."""


def refuse(path: str | os.PathLike, problems: Sequence["Problem"], what: str) -> None:
    """Raise :class:`BenchmarkDataError` listing ``problems`` (at most 20), if there are any.

    A benchmark is refused whole rather than scored without its bad items: a dropped item
    (or one read wrongly) changes the score without a trace.
    """
    if not problems:
        return
    lines = [p.message(str(path)).removeprefix(f"{path}: ") for p in problems[:20]]
    if len(problems) > 20:
        lines.append(f"... and {len(problems) - 20} more")
    raise BenchmarkDataError(
        f"{path}: {len(problems)} problem(s) in this {what}; an evaluation reads every item or none, so fix "
        "them (or remove those records) and run again:\n  - " + "\n  - ".join(lines)
    )


class _Object(dict):
    """A parsed JSON object that keeps its key/value pairs as written (duplicates included)."""

    def __init__(self, pairs: list[tuple[str, Any]]):
        super().__init__(pairs)
        self.pairs = pairs


def read_records(path: str | os.PathLike) -> tuple[list[tuple[str, Any]], list["Problem"]]:
    """``([(key, record), ...], problems)`` of a benchmark file, read as strictly as training data.

    A JSON list or JSON lines go through the training readers
    (:func:`mmtune.data.readers.iter_records`: a line that is no JSON, a ``\\ud800`` escape
    that is no character, nesting too deep: a problem of that record, named); ``key`` is
    ``None`` for them. A JSON object (MM-Vet's ``{"v1_0": {...}}``) gives one record per key,
    and a key written twice is a ``duplicate_id`` (a JSON parser keeps the last silently).

    Raises:
        FileNotFoundError: no such file.
        BenchmarkDataError: the file is no JSON list, JSON lines or JSON object.
    """
    from mmtune.data.readers import iter_records, surrogate_problem
    from mmtune.data.validation import DataValidationError, Problem

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found; check the benchmark's data_path / predictions setting")
    with path.open("rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if path.suffix != ".jsonl" and head.startswith(b"{"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_Object)
        except UnicodeDecodeError as err:
            raise BenchmarkDataError(f"{path}: not UTF-8 ({err}); re-encode the file as UTF-8") from None
        except RecursionError:
            raise BenchmarkDataError(f"{path}: nested deeper than the JSON parser can follow") from None
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # "Extra data": one object per line, JSON lines (read below)
                raise BenchmarkDataError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column "
                                         f"{err.colno})") from None
        else:
            records, problems, seen = [], [], set()
            for index, (key, value) in enumerate(data.pairs):
                found = surrogate_problem({key: value}, index, str(key).encode("utf-8", "backslashreplace").decode())
                if found is not None:
                    problems.append(found)
                elif key in seen:
                    problems.append(Problem("duplicate_id", key, index, None, "key written again later in the object"))
                seen.add(key)
                records.append((key, value))
            return records, problems
    records, problems = [], []
    try:
        for index, value, problem in iter_records(str(path)):
            if problem is not None:
                problems.append(problem)
            else:
                records.append((None, value))
    except DataValidationError as err:
        raise BenchmarkDataError(str(err)) from None
    return records, problems


def load_mmdu_dialogues(
    path: str | os.PathLike, *, image_root: Optional[str] = None, source: str = "mmdu", limit: Optional[int] = None,
    allow_absolute_image_paths: bool = False, check_images: str = "none", image_limits: Any = None,
    answers: bool = False,
) -> list[Dialogue]:
    """Read an MMDU-schema file (a JSON list or JSON lines) into dialogues, refusing it whole
    when any record is bad.

    The records are converted and checked by the training readers
    (:func:`mmtune.data.readers.read_source`, format ``mmdu``): a record that is no object, a
    message that is a plain string, two user turns in a row, a placeholder/image count
    mismatch, an image path outside the root or holding a NUL byte, a lone surrogate, a
    duplicate id: every problem of every record is listed with file, record, turn and fix.

    Args:
        check_images: ``none``: image paths are resolved, the files not opened (scoring a
            predictions file needs no image); ``verify``: every file exists, opens as an image
            and is within ``image_limits`` (what generating or sending images needs).
        answers: the assistant turns hold a model's answers (a predictions file), where an
            empty answer is an answer and not an empty turn.

    Raises:
        BenchmarkDataError: listing the problems (at most 20 shown).
    """
    from mmtune.data.config import SourceConfig
    from mmtune.data.readers import read_source

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found; check the benchmark's data_path / predictions setting")
    config = SourceConfig(name=source, format="mmdu", path=str(path), image_root=image_root)
    dialogues, problems = [], []
    for dialogue, found in read_source(config, check_images=check_images, image_limits=image_limits, limit=limit,
                                       allow_absolute_image_paths=allow_absolute_image_paths):
        if answers and dialogue is not None:
            found = [p for p in found if not (p.code == "empty_turn" and p.turn_index is not None
                                              and dialogue.turns[p.turn_index].role == "assistant")]
        problems += found
        if dialogue is not None and not found:
            dialogues.append(dialogue)
    refuse(path, problems, "MMDU-schema file (a JSON list or JSON lines of {id, image, conversations})")
    return dialogues


def load_prompt(default_name: str, user_file: Optional[str], fields: Iterable[str]) -> str:
    """The built-in prompt ``prompts/<default_name>`` or a user's replacement file.

    Raises:
        ValueError: when the user's template lacks one of the ``{field}`` placeholders.
    """
    path = Path(user_file) if user_file else PROMPT_DIR / default_name
    template = path.read_text(encoding="utf-8")
    missing = [f for f in fields if "{" + f + "}" not in template]
    if missing:
        raise ValueError(
            f"prompt file {path} lacks the placeholder(s) {', '.join('{' + m + '}' for m in missing)}; "
            "a replacement prompt must contain each of them once"
        )
    return template


def fill_prompt(template: str, **fields: str) -> str:
    """Replace ``{name}`` placeholders in one pass. Other braces (a JSON example in the
    prompt) stay as they are, and braces inside the inserted texts are never re-expanded."""
    pattern = re.compile(r"\{(" + "|".join(re.escape(k) for k in fields) + r")\}")
    return pattern.sub(lambda m: fields[m.group(1)], template)


@dataclass
class TurnPrediction:
    answer: str
    meta: dict[str, Any]


def load_turn_predictions(path: str | os.PathLike) -> dict[tuple[str, int], TurnPrediction]:
    """Model answers keyed by ``(dialogue_id, exchange_index)``.

    Accepts an mmtune generation JSONL (``{"dialogue_id", "turn", "answer", ...}`` per
    line) or an MMDU-schema JSON list whose assistant turns hold the model's answers.
    Skipped turns of a generation file (context overflow) are left out, so they count as
    missing answers.
    """
    data = load_json_or_jsonl(path)
    out: dict[tuple[str, int], TurnPrediction] = {}
    if isinstance(data, list) and data and isinstance(data[0], dict) and "dialogue_id" in data[0]:
        for record in data:
            if record.get("answer") is not None:
                meta = {k: v for k, v in record.items() if k not in ("answer",)}
                out[(str(record["dialogue_id"]), int(record["turn"]))] = TurnPrediction(record["answer"], meta)
        return out
    # image paths are resolved but never opened: scoring a predictions file needs no images
    for dialogue in load_mmdu_dialogues(path, allow_absolute_image_paths=True, answers=True):
        for t, (_, a) in enumerate(dialogue.exchanges()):
            out[(dialogue.id, t)] = TurnPrediction(dialogue.turns[a].text, {})
    return out
