"""Generated multi-image dialogues shared by the generation tests of several rooms."""

from __future__ import annotations

from typing import Optional

from mmtune.core.dialogue import Dialogue, Image, Turn


def numbered_dialogue(paths: list[str], k: int, images: list[int], *, turns: Optional[int] = None, words: int = 1,
                      name: Optional[str] = None) -> Dialogue:
    """Dialogue ``d<k>`` (or ``name``) of ``turns`` exchanges (default ``len(images)``):
    ``images[t]`` images in turn t (0, or past the list: text only), taken from ``paths``; later
    turns name earlier images, and turn t's question carries ``words * (t % 3)`` extra words."""
    out, seen = [], 0
    for t in range(len(images) if turns is None else turns):
        n = images[t] if t < len(images) else 0
        segments: list = []
        for _ in range(n):
            seen += 1
            segments += [f"Image{seen}: ", Image(paths[(k + seen) % len(paths)]), "\n"]
        question = f"What is in Image{max(seen, 1)}?" if n else f"Compare Image1 and Image{max(seen, 1)}."
        segments.append(" ".join([question] + ["please"] * (words * (t % 3))))
        out += [Turn("user", tuple(segments)), Turn("assistant", (f"ref {k}-{t}",))]
    return Dialogue(name or f"d{k}", "test", tuple(out))
