"""The one normalized dialogue type every data format converts into.

Nothing downstream of the readers (collator, training, evaluation) knows which file
format a dialogue came from: it sees a :class:`Dialogue` made of ordered
:class:`Turn` objects, each an ordered tuple of text strings and :class:`Image`
segments. An image segment sits exactly where its placeholder stood in the source
text, so "images placed where their placeholders are" is a property of the type, not
of a later string search.

Example::

    Dialogue(
        id="mmdu-0",
        source="mmdu",
        turns=(
            Turn("user", ("Image1: ", Image("/pics/a.jpg"), ". What is shown?")),
            Turn("assistant", ("A red square.",)),
        ),
    )
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

__all__ = ["ROLES", "Dialogue", "Image", "Segment", "Turn", "turn_label"]

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Image:
    """An image segment: the resolved path of the image file on disk."""

    path: str
    root: Optional[str] = field(default=None, compare=False)
    """The image root the file was found inside when the data was read; whoever sends the
    file elsewhere opens it only inside this root (:func:`mmtune.io.confined.read_inside`).
    ``None``: not confined (absolute paths allowed, or a path made by code)."""


Segment = Union[str, Image]


@dataclass(frozen=True)
class Turn:
    """One message: a role and its ordered text / image segments."""

    role: str
    segments: tuple[Segment, ...]

    @property
    def text(self) -> str:
        """The turn's text with image segments left out."""
        return "".join(s for s in self.segments if isinstance(s, str))

    @property
    def images(self) -> tuple[Image, ...]:
        return tuple(s for s in self.segments if isinstance(s, Image))


@dataclass(frozen=True)
class Dialogue:
    """An ordered conversation. ``images`` lists image segments in order of appearance."""

    id: str
    source: str
    turns: tuple[Turn, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def images(self) -> tuple[Image, ...]:
        return tuple(image for turn in self.turns for image in turn.images)

    @property
    def num_images(self) -> int:
        return sum(1 for turn in self.turns for segment in turn.segments if type(segment) is Image)

    def exchanges(self) -> Iterator[tuple[int, int]]:
        """Yield ``(user_turn_index, assistant_turn_index)`` pairs in order.

        A leading system turn is skipped. Validation guarantees strict alternation,
        so each user turn is followed by its assistant turn.
        """
        start = 1 if self.turns and self.turns[0].role == "system" else 0
        for i in range(start, len(self.turns) - 1, 2):
            yield i, i + 1

    # Arrow-friendly flat form, used by the datasets cache. Every segment is a struct
    # with both keys so the schema is fixed: {"text": str | None, "image": str | None}.
    def to_record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "source": self.source,
            "roles": [turn.role for turn in self.turns],
            "segments": [
                [
                    {"text": s, "image": None} if isinstance(s, str) else {"text": None, "image": s.path}
                    for s in turn.segments
                ]
                for turn in self.turns
            ],
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Dialogue":
        turns = tuple(
            Turn(
                role,
                tuple(Image(seg["image"]) if seg["image"] is not None else seg["text"] for seg in segments),
            )
            for role, segments in zip(record["roles"], record["segments"])
        )
        return cls(id=record["id"], source=record["source"], turns=turns)


def turn_label(message_index: int | None, system_first: bool = False) -> str:
    """``turn 2 (answer)`` for the 4th message of a record (``turn 2 (question)`` for the 3rd):
    turns count question/answer exchanges from 1, as the evaluation's details files,
    ``report.md`` and ``viewer.html`` do; a leading system message is no exchange."""
    if message_index is None:
        return ""
    position = message_index - int(system_first)
    if position < 0:
        return "system message"
    return f"turn {position // 2 + 1} ({'question' if position % 2 == 0 else 'answer'})"
