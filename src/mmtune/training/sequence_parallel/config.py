"""``training.sequence_parallel``: how many ranks share one row."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SequenceParallelConfig"]


@dataclass
class SequenceParallelConfig:
    """Sequence parallelism (see ``docs/training.md``, "Sequence parallelism")."""

    size: int = 1
    """Ranks sharing each row (``N``): each holds ``1/N`` of the row's tokens through the
    decoder, so rows up to ``N`` times longer fit the same activation memory. Must divide the
    number of launched ranks and the language model's attention and key/value head counts;
    needs ``model.attn_implementation`` sdpa or eager. ``1``: off."""
