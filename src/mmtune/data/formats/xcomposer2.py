"""``xcomposer2``: InternLM-XComposer2's fine-tune JSON, the ``mmdu`` layout with roles
``user``/``human`` and ``assistant``/``bot``/``gpt``. Its ``data.txt`` (``path
count_in_thousands`` per line) becomes one source per line:
:func:`mmtune.data.readers.sources_from_datatxt`.
"""

from __future__ import annotations

from typing import Optional

from mmtune.data.formats.conversations import MMDU_PLACEHOLDER, ConversationsFormat, Shape
from mmtune.data.formats.mmdu import XCOMPOSER2_ROLES
from mmtune.data.formats.registry import register_format


@register_format
class Xcomposer2(ConversationsFormat):
    name = "xcomposer2"
    keys = "a 'conversations' list of {from, value} turns with <ImageHere> placeholders and roles human/gpt/bot"
    placeholder = MMDU_PLACEHOLDER

    def fits(self, found: Shape) -> Optional[str]:
        if not found.mmdu_like or not found.roles & XCOMPOSER2_ROLES:
            return None
        return f"'<ImageHere>' placeholders with roles {sorted(found.roles)} (InternLM-XComposer2 fine-tune JSON)"
