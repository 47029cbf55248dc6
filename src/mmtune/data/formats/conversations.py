"""The ``conversations`` layout shared by ``llava``, ``mmdu`` and ``xcomposer2``: a record is
``{"id", "image"?, "conversations": [{"from", "value"}]}`` whose k-th image placeholder in
the whole dialogue is the k-th path of ``image`` (a path or a list). The three differ in
the placeholder, the roles they spell and, for llava, where the image goes in its turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

from mmtune.core.dialogue import Dialogue, Image, Turn
from mmtune.data.formats.base import (ROLE_MAP, ConvertContext, DataFormat, Detection, first_role_is_system,
                                      not_an_object, record_id)
from mmtune.data.validation import Problem

__all__ = ["ConversationsFormat", "Shape", "shape"]

LLAVA_PLACEHOLDER = "<image>"
MMDU_PLACEHOLDER = "<ImageHere>"


def _split(text: str, placeholder: str, images: Iterator[Image]) -> tuple:
    if placeholder not in text:  # most turns
        return (text,) if text else ()
    parts = text.split(placeholder)
    segments: list = []
    for i, part in enumerate(parts):
        if i:
            segments.append(next(images))
        if part:
            segments.append(part)
    return tuple(segments)


@dataclass(frozen=True)
class Shape:
    """What a file's first records look like in this layout (for detection)."""

    roles: frozenset
    llava_marks: int
    mmdu_marks: int
    list_images: bool

    @property
    def mmdu_like(self) -> bool:
        """``<ImageHere>`` placeholders, or image lists without ``<image>``."""
        return self.mmdu_marks > self.llava_marks or (self.list_images and not self.llava_marks)


def shape(records: list[dict]) -> tuple[Optional[Shape], str]:
    """``(shape, "")`` of records in this layout, or ``(None, why not)``; records whose
    majority has a ``messages`` list are not (that is the ``messages`` format)."""
    if sum("messages" in r for r in records) > len(records) / 2:
        return None, ""
    convs = [r for r in records if isinstance(r.get("conversations"), list)]
    if not convs:
        return None, ""
    # Only strings are looked at: a value may be any JSON, nested deeper than str() follows.
    messages = [m for r in convs for m in r["conversations"] if isinstance(m, dict)]
    texts = [m["value"] for m in messages if isinstance(m.get("value"), str)]
    roles = frozenset(m["from"] for m in messages if isinstance(m.get("from"), str))
    if not texts or not roles:
        turn = next((m for m in convs[0]["conversations"]), None)
        first = str(sorted(map(str, turn))[:12]) if isinstance(turn, dict) else (
            "missing" if turn is None else f"a {type(turn).__name__}, not an object")
        return None, ("records have 'conversations', but its turns are not {from, value}: the first record's first "
                      f"turn is {first}. Write turns as {{\"from\": \"human\", \"value\": \"...\"}}, or put "
                      "{role, content} messages under 'messages'")
    return Shape(roles, sum(t.count(LLAVA_PLACEHOLDER) for t in texts), sum(t.count(MMDU_PLACEHOLDER) for t in texts),
                 any(isinstance(r.get("image"), list) for r in convs)), ""


class ConversationsFormat(DataFormat):
    """A format of the ``conversations`` layout; subclasses set ``placeholder`` and :meth:`fits`."""

    placeholder: str = ""

    def fits(self, found: Shape) -> Optional[str]:
        """Why records of ``found`` shape are this format, or ``None``."""
        raise NotImplementedError

    def detect(self, records: list[dict]) -> Detection:
        found, why_not = shape(records)
        if found is None:
            return Detection(0, why_not)
        why = self.fits(found)
        return Detection(1, why) if why else Detection(0)

    def system_first(self, record: Any) -> bool:
        return first_role_is_system(record, "conversations", "from")

    def convert(self, obj: Any, index: int, ctx: ConvertContext) -> tuple[Optional[Dialogue], list[Problem]]:
        placeholder = self.placeholder
        if not isinstance(obj, dict):
            return not_an_object(obj, index)
        rid = record_id(obj, ctx.source, index)

        def bad(detail: str, turn: int | None = None, code: str = "malformed_record"):
            return None, [Problem(code, rid, index, turn, detail)]

        conv = obj.get("conversations")
        if not isinstance(conv, list):
            return bad("no 'conversations' list")
        raw_images = obj.get("image")
        if raw_images is None:
            raw_images = []
        elif isinstance(raw_images, str):
            raw_images = [raw_images]
        if not isinstance(raw_images, list) or not all(isinstance(p, str) and p for p in raw_images):
            return bad("'image' must be a path or a list of non-empty paths")
        count = 0
        for t, msg in enumerate(conv):
            if not isinstance(msg, dict) or not isinstance(msg.get("value"), str) or not isinstance(msg.get("from"), str):
                return bad("turn must be an object with string 'from' and 'value'", t)
            count += msg["value"].count(placeholder)
        if count != len(raw_images):
            return bad(f"{count} {placeholder} placeholder(s), {len(raw_images)} image path(s)", None,
                       "placeholder_mismatch")
        resolved = [ctx.resolve(p) for p in raw_images]
        for k, image in enumerate(resolved):
            if image.problem:
                seen, turn = 0, None
                for t, msg in enumerate(conv):
                    seen += msg["value"].count(placeholder)
                    if seen > k:
                        turn = t
                        break
                return bad(image.detail, turn, image.problem)
        images = iter([Image(image.path, image.root) for image in resolved])
        turns = []
        for msg in conv:
            value = msg["value"]
            if ctx.move_image_to_start and placeholder in value:
                # LLaVA-1.5's preprocess_multimodal: the turn holding the image becomes
                # "<image>\n" + its stripped text ("<image>" alone when there is no text)
                value = (placeholder + "\n" + value.replace(placeholder, "").strip()).strip()
            turns.append(Turn(ROLE_MAP.get(msg["from"], msg["from"]), _split(value, placeholder, images)))
        return Dialogue(rid, ctx.source, tuple(turns)), []
