"""Sequence-parallel process groups: ``N`` consecutive ranks hold one row between them.

With ``world`` ranks and ``training.sequence_parallel.size = N`` (``N`` dividing
``world``) ranks ``0..N-1`` form the first group, ``N..2N-1`` the second, and so on.
Every rank of a group is handed the same micro-batches (the data module sees
``world / N`` data-parallel ranks) and keeps one contiguous ``1/N`` of every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["SPGroups", "head_problems", "new_groups", "planned_head_problems", "size_problems"]


@dataclass(frozen=True)
class SPGroups:
    """This rank's place in the sequence-parallel layout."""

    size: int
    """Ranks sharing one row (``N``)."""
    rank: int
    """This rank's index inside its group: it holds the row's shard number ``rank``."""
    group: Optional[Any]
    """The group's ``ProcessGroup`` (``None`` when ``size`` is 1)."""
    dp_rank: int
    """Index of this rank's group among all groups: its data-parallel rank."""
    dp_size: int
    """Number of groups: the data-parallel world the data module plans for."""


def size_problems(size: int, world_size: int) -> list[str]:
    """What is wrong with sequence parallelism of ``size`` on ``world_size`` ranks (empty when nothing)."""
    if size < 1:
        return [f"training.sequence_parallel.size={size} must be >= 1"]
    if world_size % size:
        return [f"training.sequence_parallel.size={size} does not divide the {world_size} launched ranks: use a "
                f"divisor of {world_size} or launch a multiple of {size} processes"]
    return []


def head_problems(text_config: Any, size: int) -> list[str]:
    """Why the language model's heads cannot be spread over ``size`` ranks (empty when they can).

    The Ulysses exchange gives every rank ``heads / N`` query heads and ``kv_heads / N``
    key/value heads of the whole row, so both must divide by ``N``.
    """
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    problems = []
    for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count % size:
            problems.append(f"the language model's {count} {name} do not divide by "
                            f"training.sequence_parallel.size={size}")
    return problems


def planned_head_problems(model_cfg: Any, adapter: Any, size: int) -> list[str]:
    """:func:`head_problems` of ``model_cfg``'s model read from its config alone (a meta-device
    build, no weights), so a layout that cannot split its heads stops before the model loads."""
    from mmtune.training.plan.model import meta_model

    model, _ = meta_model(model_cfg)
    return head_problems(adapter.text_config(model.config), size)


def new_groups(size: int) -> SPGroups:
    """Create every sequence-parallel group (every rank must call this, in the same order).

    A group of its own even when it spans the whole world: the Ulysses exchange runs inside
    autograd's backward while the engine reduces gradients on the default group, and with a
    group per concern neither can take the other's collective for its own.

    Raises:
        ValueError: ``size`` does not divide the world size (with both numbers).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    problems = size_problems(size, world)
    if problems:
        raise ValueError("; ".join(problems))
    if size == 1:
        return SPGroups(1, 0, None, rank, world)
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SPGroups(size, rank % size, mine, rank // size, world // size)
