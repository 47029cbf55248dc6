"""Fixtures of the generation tests."""

from __future__ import annotations

import pytest

from mmtune.core.dialogue import Dialogue
from tests.support.dialogues import numbered_dialogue


def _mixed_dialogues(paths: list[str]) -> list[Dialogue]:
    """Nine dialogues over the images ``paths``: 1 to 7 exchanges, text-only turns, turns of up to
    three images, questions of different lengths (rows of a batch end at different steps)."""
    return [
        numbered_dialogue(paths, 0, turns=1, images=[1]),
        numbered_dialogue(paths, 1, turns=2, images=[2, 0]),
        numbered_dialogue(paths, 2, turns=5, images=[1, 0, 1, 0, 0], words=3),
        numbered_dialogue(paths, 3, turns=3, images=[0, 1, 2]),
        numbered_dialogue(paths, 4, turns=4, images=[3, 0, 0, 1]),
        numbered_dialogue(paths, 5, turns=2, images=[0, 0], words=5),
        numbered_dialogue(paths, 6, turns=6, images=[1, 1, 1, 0, 0, 0]),
        numbered_dialogue(paths, 7, turns=3, images=[1, 0, 0], words=8),
        numbered_dialogue(paths, 8, turns=7, images=[2, 1, 2, 1, 2, 1, 0], words=4, name="long"),
    ]


@pytest.fixture(scope="session")
def mixed_dialogues():
    """``mixed_dialogues(paths)``: the batched-generation tests' dialogue set over the given images."""
    return _mixed_dialogues
