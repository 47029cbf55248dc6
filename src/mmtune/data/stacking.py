"""Dialogue stacking (MMDU paper, appendix C.1): several dialogues become one longer one.

Dialogues of one source are drawn in a seeded order and concatenated greedily while
the stack stays within an image budget and an estimated-token budget (a dialogue
over budget on its own stays alone; nothing is dropped). Turns keep their order;
image segments keep their place, so the k-th image of the stack is the k-th image
segment, and image references in the text are renumbered so each still names its own
image: when the dialogues before it have ``k`` images in total, a dialogue's
``Image1`` becomes ``Image{k+1}``.

Reference forms renumbered (case of "image" kept, number ``N`` between 1 and the
dialogue's own image count; other numbers are left untouched because they cannot
name one of its images)::

    Image1   Image 2   image3   <image-4>   <image 5>

A dialogue that starts with a system turn contributes it only when it opens the stack;
later ones must carry the same system text (it is then dropped) or stacking raises.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmtune.data.dialogue import Dialogue, Turn
from mmtune.data.keys import record_key

_REF = re.compile(r"(?<![A-Za-z])([Ii]mage)( ?)(\d+)(?!\d)|<(image)([- ])(\d+)>")


def renumber_image_refs(text: str, offset: int, num_images: int) -> str:
    """Add ``offset`` to every image reference numbered 1..``num_images`` in ``text``."""
    if offset == 0:
        return text

    def sub(m: re.Match) -> str:
        if m.group(1) is not None:
            word, sep, num = m.group(1), m.group(2), int(m.group(3))
            return f"{word}{sep}{num + offset}" if 1 <= num <= num_images else m.group(0)
        word, sep, num = m.group(4), m.group(5), int(m.group(6))
        return f"<{word}{sep}{num + offset}>" if 1 <= num <= num_images else m.group(0)

    return _REF.sub(sub, text)


def stack_dialogues(dialogues: Sequence[Dialogue], *, source: str | None = None) -> Dialogue:
    """Concatenate dialogues into one, renumbering image references.

    Raises:
        ValueError: a later dialogue has a system turn different from the first one's.
    """
    if len(dialogues) == 1:
        return dialogues[0]
    turns: list[Turn] = []
    system = None
    offset = 0
    for n, d in enumerate(dialogues):
        body = d.turns
        if body and body[0].role == "system":
            if n == 0:
                system = body[0].text
                turns.append(body[0])
            elif body[0].text != system:
                raise ValueError(
                    f"cannot stack dialogue {d.id!r} after {dialogues[0].id!r}: their system turns differ; "
                    "stack only sources that share one system prompt"
                )
            body = body[1:]
        k = d.num_images
        for t in body:
            turns.append(
                Turn(t.role, tuple(renumber_image_refs(s, offset, k) if isinstance(s, str) else s for s in t.segments))
            )
        offset += k
    return Dialogue(
        id="+".join(d.id for d in dialogues),
        source=source or dialogues[0].source,
        turns=tuple(turns),
        meta={"stacked_from": [d.id for d in dialogues], "key": "+".join(record_key(d) for d in dialogues)},
    )


def plan_stacks(
    num_images: np.ndarray,
    est_tokens: np.ndarray,
    *,
    max_images: int,
    max_tokens: int,
    seed: int = 0,
    shuffle: bool = True,
) -> list[list[int]]:
    """Greedy groups of record indices within the budgets; every index appears once."""
    n = len(num_images)
    order = np.random.default_rng([seed, 7919]).permutation(n) if shuffle else np.arange(n)
    groups: list[list[int]] = []
    cur: list[int] = []
    imgs = toks = 0
    for i in order.tolist():
        ni, nt = int(num_images[i]), int(est_tokens[i])
        if cur and (imgs + ni > max_images or toks + nt > max_tokens):
            groups.append(cur)
            cur, imgs, toks = [], 0, 0
        cur.append(i)
        imgs += ni
        toks += nt
    if cur:
        groups.append(cur)
    return groups


class StackedDialogues(Sequence):
    """Lazily stacked view: item ``i`` is the stack of ``groups[i]`` of the base dialogues."""

    def __init__(self, base: Sequence[Dialogue], groups: list[list[int]], source: str | None = None):
        self.base, self.groups, self.source = base, groups, source

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return stack_dialogues([self.base[j] for j in self.groups[i]], source=self.source)


@dataclass
class StackedSource:
    """A source whose items are stacks; same attributes as ``SourceData`` for mixing."""

    name: str
    config: Any
    dialogues: StackedDialogues
    report: Any
    groups: list[list[int]]
    num_images: np.ndarray
    num_chars: np.ndarray

    def estimated_tokens(self, tokens_per_image: int) -> np.ndarray:
        return self.num_chars // 4 + self.num_images.astype(np.int64) * tokens_per_image


def stack_source(source: Any, *, max_images: int, max_tokens: int, tokens_per_image: int, seed: int = 0) -> StackedSource:
    """Stack a loaded source's dialogues within the budgets (token estimate as in mixing)."""
    imgs, chars = source.num_images, source.num_chars
    groups = plan_stacks(
        imgs, source.estimated_tokens(tokens_per_image), max_images=max_images, max_tokens=max_tokens, seed=seed
    )
    return StackedSource(
        name=source.name,
        config=source.config,
        dialogues=StackedDialogues(source.dialogues, groups, source.name),
        report=source.report,
        groups=groups,
        num_images=np.array([int(imgs[g].sum()) for g in groups], dtype=np.int64),
        num_chars=np.array([int(chars[g].sum()) for g in groups], dtype=np.int64),
    )


__all__ = ["renumber_image_refs", "stack_dialogues", "plan_stacks", "StackedDialogues", "StackedSource", "stack_source"]
