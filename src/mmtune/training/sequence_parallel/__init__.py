"""Sequence parallelism: one long row (a dialogue or a packed row) trained on ``N`` ranks at once.

The row is cut into ``N`` contiguous token shards after the images' features have been
merged into its embeddings; each rank runs the decoder on its shard and the layers attend
across shards with the Ulysses exchange. Positions, sample boundaries and next-token
targets are those of the whole row, sliced; the loss and the gradients summed over the
group equal the one-process run's. See ``docs/training.md`` ("Sequence parallelism").

- :mod:`.groups`: which ranks share a row; what the layout and the head counts allow.
- :mod:`.shard`: padding, shard bounds, positions, sample boundaries, targets.
- :mod:`.ulysses`: the all-to-all exchange and the attention registered with transformers.
- :mod:`.vision`: each image encoded once per group, features exchanged.
- :mod:`.runtime`: :class:`SequenceParallel`, the step context the training loop uses.
"""

from mmtune.training.sequence_parallel.config import SequenceParallelConfig
from mmtune.training.sequence_parallel.groups import SPGroups, head_problems, new_groups, size_problems
from mmtune.training.sequence_parallel.runtime import SequenceParallel, setup_problems

__all__ = ["SPGroups", "SequenceParallel", "SequenceParallelConfig", "head_problems", "new_groups", "setup_problems", "size_problems"]
