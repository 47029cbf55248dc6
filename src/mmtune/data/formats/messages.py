"""``messages``: JSONL of ``{"id"?, "messages": [{"role", "content"}]}`` (OpenAI chat style)
where content is a string or a list of parts ``{"type": "text", "text"}``, ``{"type":
"image_url", "image_url": {"url": path}}`` or ``{"type": "image", "image"|"path"|"url": path}``.
Image paths are real paths on this machine (absolute ones need
``data.allow_absolute_image_paths``); inline (``data:``) and remote images are refused.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from mmtune.core.dialogue import Dialogue, Image, Turn
from mmtune.data.formats.base import (ROLE_MAP, ConvertContext, DataFormat, Detection, first_role_is_system,
                                      not_an_object, record_id)
from mmtune.data.formats.registry import register_format
from mmtune.data.validation import Problem


def _image_part_path(part: dict) -> str | None:
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
    else:
        url = part.get("image") or part.get("path") or part.get("url")
    return url if isinstance(url, str) and url else None


@register_format
class Messages(DataFormat):
    name = "messages"
    keys = "a 'messages' list of {role, content}"
    joins_rooted_paths = False  # user-made chat files carry real absolute paths

    def detect(self, records: list[dict]) -> Detection:
        # above the conversations formats: a file mixing both layouts is read as messages
        if sum("messages" in r for r in records) > len(records) / 2:
            return Detection(2, "records have a 'messages' list (OpenAI chat style)")
        return Detection(0)

    def system_first(self, record: Any) -> bool:
        return first_role_is_system(record, "messages", "role")

    def convert(self, obj: Any, index: int, ctx: ConvertContext) -> tuple[Optional[Dialogue], list[Problem]]:
        if not isinstance(obj, dict):
            return not_an_object(obj, index)
        rid = record_id(obj, ctx.source, index)
        msgs = obj.get("messages")
        if not isinstance(msgs, list):
            return None, [Problem("malformed_record", rid, index, None, "no 'messages' list")]
        turns = []
        for t, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return None, [Problem("malformed_record", rid, index, t, "message must be an object with a string 'role'")]
            content = m.get("content")
            if isinstance(content, str):
                segments: tuple = (content,) if content else ()
            elif isinstance(content, list):
                segs = []
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "text" and isinstance(part.get("text"), str):
                        if part["text"]:
                            segs.append(part["text"])
                    elif kind in ("image_url", "image"):
                        url = _image_part_path(part)
                        if url is None:
                            return None, [Problem("malformed_record", rid, index, t, "image part without a path")]
                        if url.startswith("data:") or re.match(r"^[a-z]+://", url) and not url.startswith("file://"):
                            return None, [
                                Problem(
                                    "malformed_record", rid, index, t,
                                    f"image {url[:40]!r} is inline or remote: save it as a local file and use its path",
                                )
                            ]
                        image = ctx.resolve(url)
                        if image.problem:
                            return None, [Problem(image.problem, rid, index, t, image.detail)]
                        segs.append(Image(image.path, image.root))
                    else:
                        return None, [Problem("malformed_record", rid, index, t,
                                              f"unknown content part {str(part)[:60]}")]
                segments = tuple(segs)
            else:
                return None, [Problem("malformed_record", rid, index, t, "'content' must be a string or a list of parts")]
            turns.append(Turn(ROLE_MAP.get(m["role"], m["role"]), segments))
        return Dialogue(rid, ctx.source, tuple(turns)), []
