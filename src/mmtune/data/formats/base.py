"""What a data format is: :class:`DataFormat` (detect, convert, name its keys) and the
context a conversion runs in (:class:`ConvertContext`: the source's name and image path rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from mmtune.core.dialogue import Dialogue
from mmtune.data.paths import ImagePathRules, ResolvedImage
from mmtune.data.validation import Problem

__all__ = ["ROLE_MAP", "ConvertContext", "DataFormat", "Detection", "first_role_is_system", "not_an_object",
           "record_id"]

# Known role spellings of all formats; anything else is kept verbatim and reported as
# unknown_role by validation.
ROLE_MAP = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class ConvertContext:
    """What a conversion needs besides the record: the source's name, its image path rule and
    whether the turn holding an image starts with it (``SourceConfig.move_image_to_start``)."""

    source: str
    rules: ImagePathRules
    move_image_to_start: bool
    origins: dict = field(default_factory=dict)
    """Resolved path -> how it was built (for missing-image reports)."""

    def resolve(self, path: str) -> ResolvedImage:
        resolved = self.rules.resolve(path)
        if len(self.origins) < 100_000:  # bounded: only used to explain problems
            self.origins[resolved.path] = resolved.how
        return resolved


@dataclass(frozen=True)
class Detection:
    """How well a file's first records fit a format."""

    score: float
    """0: not this format; otherwise the format with the highest score is the file's."""
    why: str = ""
    """Why it fits (stated in the data check's report); for a score of 0, what is close but
    wrong about the records (shown when no format fits), or empty."""


class DataFormat:
    """One file format: records of a JSON list or JSONL file -> :class:`Dialogue`.

    Subclass, set the class attributes, implement :meth:`convert` and :meth:`detect`, and
    decorate with :func:`~mmtune.data.formats.registry.register_format`.
    """

    name: ClassVar[str] = ""
    """The format's name (``SourceConfig.format``, ``--format``)."""
    keys: ClassVar[str] = ""
    """What its records hold, as the message for a file of no known format lists it
    (``a 'messages' list of {role, content}``)."""
    joins_rooted_paths: ClassVar[bool] = True
    """Absolute image paths are the data set's own (``/mmdu_pics/x.jpg``) and are joined under
    the image root; ``False``: they are real paths on this machine (user-made chat files)."""
    image_to_start: ClassVar[Optional[bool]] = None
    """Default of ``move_image_to_start`` for this format; ``None``: the format has no such option."""

    def convert(self, record: Any, index: int, ctx: ConvertContext) -> tuple[Optional[Dialogue], list[Problem]]:
        """Record number ``index`` of a file -> its dialogue, or ``None`` and the problems preventing it."""
        raise NotImplementedError

    def detect(self, records: list[dict]) -> Detection:
        """How well the first object records of a file fit this format."""
        raise NotImplementedError

    def system_first(self, record: Any) -> bool:
        """Whether a raw record's first message is a system message (reports number turns without it)."""
        return False


def first_role_is_system(record: Any, turns_key: str, role_key: str) -> bool:
    """Whether ``record[turns_key][0][role_key]`` spells the system role."""
    turns = record.get(turns_key) if isinstance(record, dict) else None
    first = turns[0] if isinstance(turns, list) and turns else None
    role = first.get(role_key) if isinstance(first, dict) else None
    return isinstance(role, str) and ROLE_MAP.get(role, role) == "system"


def record_id(obj: dict, source: str, index: int) -> str:
    """A record's ``id``, or ``<source>-<index>`` when it has none."""
    rid = obj.get("id")
    return f"{source}-{index}" if rid is None or rid == "" else str(rid)


def not_an_object(obj: Any, index: int) -> tuple[None, list[Problem]]:
    """The problem of a record that is no JSON object."""
    return None, [Problem("malformed_record", f"#{index}", index, None, f"a {type(obj).__name__}, not an object")]
