"""``training.sequence_parallel``: how many ranks share one row."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SequenceParallelConfig", "engine_problem"]


@dataclass
class SequenceParallelConfig:
    """Sequence parallelism (see ``docs/training.md``, "Sequence parallelism")."""

    size: int = 1
    """Ranks sharing each row (``N``): each holds ``1/N`` of the row's tokens through the
    decoder, so rows up to ``N`` times longer fit the same activation memory. Must divide the
    number of launched ranks and the language model's attention and key/value head counts;
    needs ``model.attn_implementation`` sdpa or eager. ``1``: off."""


def engine_problem(size: int, engine: str, why: str, able: list[str]) -> str:
    """Why ``training.sequence_parallel.size`` is refused under ``training.backend.engine``
    (``why``: the engine's own reason), and the engines it runs under (``able``)."""
    return (f"training.sequence_parallel.size={size} with training.backend.engine={engine} is refused: {why}. Use "
            f"training.backend.engine={' or '.join(able)}, or training.sequence_parallel.size=1")
