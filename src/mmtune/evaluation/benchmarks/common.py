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
from typing import Any, Iterable, Optional

from mmtune.data.dialogue import Dialogue, Image, Turn

__all__ = [
    "IMAGE_PLACEHOLDER",
    "load_json_or_jsonl",
    "load_mmdu_dialogues",
    "resolve_image",
    "fill_prompt",
    "load_prompt",
    "load_turn_predictions",
]

IMAGE_PLACEHOLDER = "<ImageHere>"
_ROLE = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "system": "system"}
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
        ImagePathError: the path escapes the root, or is absolute outside it and
            ``allow_absolute`` is off.
    """
    from mmtune.data.paths import ImagePathRules

    return ImagePathRules(image_root or str(Path(data_file).parent), allow_absolute=allow_absolute).resolve(path).checked()


def load_mmdu_dialogues(
    path: str | os.PathLike, *, image_root: Optional[str] = None, source: str = "mmdu", limit: Optional[int] = None,
    allow_absolute_image_paths: bool = False,
) -> list[Dialogue]:
    """Read an MMDU-schema JSON list into dialogues (validation collects all problems).

    Raises:
        ValueError: listing every record with a bad role, a placeholder/image count
            mismatch, or a missing key.
    """
    path = Path(path)
    records = load_json_or_jsonl(path)
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of dialogues in MMDU schema (id, image, conversations)")
    if limit is not None:
        records = records[:limit]
    problems: list[str] = []
    dialogues = []
    for index, record in enumerate(records):
        rid = record.get("id", f"#{index}") if isinstance(record, dict) else f"#{index}"
        if not isinstance(record, dict) or "conversations" not in record:
            problems.append(f"record {rid}: missing 'conversations'")
            continue
        images = record.get("image") or []
        images = [images] if isinstance(images, str) else list(images)
        turns = []
        used = 0
        for t, message in enumerate(record["conversations"]):
            role = _ROLE.get(str(message.get("from", message.get("role", ""))).lower())
            if role is None:
                problems.append(f"record {rid}, turn {t}: unknown role {message.get('from')!r}")
                continue
            parts = str(message.get("value", message.get("content", ""))).split(IMAGE_PLACEHOLDER)
            segments: list[Any] = []
            for k, part in enumerate(parts):
                if part:
                    segments.append(part)
                if k < len(parts) - 1:
                    if used < len(images):
                        try:
                            resolved = resolve_image(images[used], image_root, path,
                                                     allow_absolute=allow_absolute_image_paths)
                        except ValueError as err:
                            problems.append(f"record {rid}, turn {t}: [path_outside_root] {err}")
                            resolved = images[used]
                        segments.append(Image(resolved))
                    used += 1
            turns.append(Turn(role, tuple(segments)))
        if used != len(images):
            problems.append(
                f"record {rid}: {used} {IMAGE_PLACEHOLDER} placeholders but {len(images)} image paths; "
                "the k-th placeholder must match the k-th entry of 'image'"
            )
        dialogues.append(Dialogue(id=str(rid), source=source, turns=tuple(turns)))
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ValueError(f"{path}: {len(problems)} problem(s):\n  - " + "\n  - ".join(shown))
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
    for dialogue in load_mmdu_dialogues(path, allow_absolute_image_paths=True):
        for t, (_, a) in enumerate(dialogue.exchanges()):
            out[(dialogue.id, t)] = TurnPrediction(dialogue.turns[a].text, {})
    return out
