"""Combining per-image and cross-image Q&A into one MMDU-format dialogue, then validating it.

Layout (MMDU's interleaving format): image k enters the dialogue in the user turn of
its first per-image question, as ``Image{k}: <ImageHere>`` on its own line, so later
questions can name it; images with no per-image question enter at the first
cross-image question. The record's ``image`` list follows the placeholders' order.
An image no question ends up about is left out (nothing refers to it).

Every record is converted to a :class:`~mmtune.data.dialogue.Dialogue` and run through
the data layer's :func:`~mmtune.data.validation.check_dialogue`, the same checks
``mmtune data check`` applies, so the builder never writes what the reader rejects.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.build.parsing import QA
from mmtune.data.build.sets import ImageSet
from mmtune.data.readers import MMDU_PLACEHOLDER
from mmtune.data.validation import ImageChecker, Problem, check_dialogue


def build_record(image_set: ImageSet, per_image: Sequence[Sequence[QA]], cross: Sequence[QA]) -> dict[str, Any]:
    """An MMDU record ``{"id", "image", "conversations"}`` (image paths as in the set).

    Args:
        image_set: the set the pairs were generated from.
        per_image: ``per_image[k]`` are the pairs about image ``k+1`` (``Image{k+1}`` references).
        cross: pairs across the set.
    """
    introduced: list[int] = []
    conversations: list[dict[str, str]] = []

    def intro(ks: Sequence[int]) -> str:
        for k in ks:
            introduced.append(k)
        return "".join(f"Image{k + 1}: {MMDU_PLACEHOLDER}\n" for k in ks)

    for k, pairs in enumerate(per_image):
        for i, pair in enumerate(pairs):
            prefix = intro([k]) if i == 0 else ""
            conversations += [{"from": "user", "value": prefix + pair.question},
                              {"from": "assistant", "value": pair.answer}]
    for i, pair in enumerate(cross):
        # Images without a per-image question enter at the first cross question: the set
        # as a whole is what the cross questions are about.
        prefix = intro([k for k in range(len(image_set.images)) if k not in introduced]) if i == 0 else ""
        conversations += [{"from": "user", "value": prefix + pair.question},
                          {"from": "assistant", "value": pair.answer}]
    return {
        "id": image_set.id,
        "image": [image_set.images[k].path for k in introduced],
        "conversations": conversations,
    }


def to_dialogue(record: dict[str, Any], source: str = "build") -> Dialogue:
    """The record as the MMDU reader sees it (the k-th placeholder is the k-th path)."""
    paths = iter(record["image"])
    turns = []
    for msg in record["conversations"]:
        parts = msg["value"].split(MMDU_PLACEHOLDER)
        segs: list = []
        for i, part in enumerate(parts):
            if i:
                segs.append(Image(next(paths, "")))
            if part:
                segs.append(part)
        turns.append(Turn(msg["from"], tuple(segs)))
    return Dialogue(record["id"], source, tuple(turns))


def validate_record(record: dict[str, Any], images: Optional[ImageChecker] = None) -> list[Problem]:
    """Every problem the data layer's checks find in ``record`` (empty = it will load)."""
    n_placeholders = sum(m["value"].count(MMDU_PLACEHOLDER) for m in record["conversations"])
    if n_placeholders != len(record["image"]):
        return [Problem("placeholder_mismatch", record["id"], 0, None,
                        f"{n_placeholders} placeholders, {len(record['image'])} images")]
    return check_dialogue(to_dialogue(record), 0, images)


__all__ = ["build_record", "to_dialogue", "validate_record"]
