"""Fixtures of the generation tests."""

from __future__ import annotations

import pytest

from mmtune.core.dialogue import Dialogue, Image, Turn


def _make(paths: list[str], k: int, turns: int, images: list[int], words: int = 1) -> Dialogue:
    """Dialogue ``d<k>``: ``images[t]`` images in turn t (0 = text only); later turns name earlier images."""
    out, seen = [], 0
    for t in range(turns):
        n = images[t] if t < len(images) else 0
        segments: list = []
        for _ in range(n):
            seen += 1
            segments += [f"Image{seen}: ", Image(paths[(k + seen) % len(paths)]), "\n"]
        question = f"What is in Image{max(seen, 1)}?" if n else f"Compare Image1 and Image{max(seen, 1)}."
        segments.append(" ".join([question] + ["please"] * (words * (t % 3))))
        out += [Turn("user", tuple(segments)), Turn("assistant", (f"ref {k}-{t}",))]
    return Dialogue(f"d{k}", "test", tuple(out))


def _mixed_dialogues(paths: list[str]) -> list[Dialogue]:
    """Nine dialogues over the images ``paths``: 1 to 7 exchanges, text-only turns, turns of up to
    three images, questions of different lengths (rows of a batch end at different steps)."""
    return [
        _make(paths, 0, 1, [1]),
        _make(paths, 1, 2, [2, 0]),
        _make(paths, 2, 5, [1, 0, 1, 0, 0], words=3),
        _make(paths, 3, 3, [0, 1, 2]),
        _make(paths, 4, 4, [3, 0, 0, 1]),
        _make(paths, 5, 2, [0, 0], words=5),
        _make(paths, 6, 6, [1, 1, 1, 0, 0, 0]),
        _make(paths, 7, 3, [1, 0, 0], words=8),
        Dialogue("long", "test", _make(paths, 8, 7, [2, 1, 2, 1, 2, 1, 0], words=4).turns),
    ]


@pytest.fixture(scope="session")
def mixed_dialogues():
    """``mixed_dialogues(paths)``: the batched-generation tests' dialogue set over the given images."""
    return _mixed_dialogues
