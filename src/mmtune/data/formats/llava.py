"""``llava``: llava-665k. ``{"id", "image"?, "conversations": [{"from": "human"|"gpt", "value"}]}``
with one ``<image>`` placeholder (at the start followed by a newline, or at the end) for a
record with an ``image``; records without ``image`` are text-only. By default the turn
holding ``<image>`` becomes ``"<image>\\n" + its stripped text``, as LLaVA-1.5's own
preprocessing does (``SourceConfig.move_image_to_start``).
"""

from __future__ import annotations

from typing import Optional

from mmtune.data.formats.conversations import LLAVA_PLACEHOLDER, ConversationsFormat, Shape
from mmtune.data.formats.registry import register_format


@register_format
class Llava(ConversationsFormat):
    name = "llava"
    keys = "a 'conversations' list of {from, value} turns with <image> placeholders"
    placeholder = LLAVA_PLACEHOLDER
    image_to_start = True

    def fits(self, found: Shape) -> Optional[str]:
        if found.mmdu_like:
            return None
        marks = "<image> placeholders" if found.llava_marks else "no image placeholders"
        return f"'conversations' with {marks} and roles {sorted(found.roles)} (llava-665k schema)"
