"""The dialogue type, kept importable from here: it lives in :mod:`mmtune.core.dialogue`."""

from mmtune.core.dialogue import ROLES, Dialogue, Image, Segment, Turn, turn_label

__all__ = ["ROLES", "Dialogue", "Image", "Segment", "Turn", "turn_label"]
