"""``training.sequence_parallel``: how many ranks share one row."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SequenceParallelConfig", "UNVERIFIED_ENGINES", "engine_problem"]


@dataclass
class SequenceParallelConfig:
    """Sequence parallelism (see ``docs/training.md``, "Sequence parallelism")."""

    size: int = 1
    """Ranks sharing each row (``N``): each holds ``1/N`` of the row's tokens through the
    decoder, so rows up to ``N`` times longer fit the same activation memory. Must divide the
    number of launched ranks and the language model's attention and key/value head counts;
    needs ``model.attn_implementation`` sdpa or eager. ``1``: off."""


#: engines sequence parallelism is refused under, with what was never run under them
UNVERIFIED_ENGINES = {
    "deepspeed": "not known to be wrong, but never run: DeepSpeed trains several processes only through "
                 "deepspeed.comm, which hangs on CPU (gloo) ranks, so the check that losses and gradients equal one "
                 "process's (passed under ddp and fsdp2 on 2 and 4 ranks) has not run under it, in particular ZeRO's "
                 "gradient reduction overlapping the Ulysses all-to-all in the backward, and ZeRO-3 gathering the "
                 "vision tower's weights while each rank of a group encodes its own share of the images",
}


def engine_problem(size: int, engine: str) -> str:
    """Why ``training.sequence_parallel.size`` is refused under ``training.backend.engine``
    (one outside the engines it runs under), and what to use instead."""
    why = UNVERIFIED_ENGINES.get(engine, "not supported")
    return (f"training.sequence_parallel.size={size} with training.backend.engine={engine} is refused: {why}. Use "
            "training.backend.engine=fsdp2 (weights, gradients and optimizer states sharded, as ZeRO-3) or ddp, or "
            "training.sequence_parallel.size=1")
