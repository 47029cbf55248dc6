"""``mmdu``: the MMDU benchmark and MMDU-45k. ``{"id", "image": [paths], "conversations":
[{"from": "user"|"assistant", "value"}]}``; the k-th ``<ImageHere>`` in the whole dialogue
is the k-th path.
"""

from __future__ import annotations

from typing import Optional

from mmtune.data.formats.conversations import MMDU_PLACEHOLDER, ConversationsFormat, Shape
from mmtune.data.formats.registry import register_format

#: role spellings that tell InternLM-XComposer2's fine-tune JSON (the ``xcomposer2`` format) from MMDU's
XCOMPOSER2_ROLES = frozenset({"bot", "human", "gpt"})


@register_format
class Mmdu(ConversationsFormat):
    name = "mmdu"
    keys = "a 'conversations' list of {from, value} turns with <ImageHere> placeholders and roles user, assistant"
    placeholder = MMDU_PLACEHOLDER

    def fits(self, found: Shape) -> Optional[str]:
        if not found.mmdu_like or found.roles & XCOMPOSER2_ROLES:
            return None
        return f"'<ImageHere>' placeholders with roles {sorted(found.roles)} (MMDU schema)"
