"""One training step under sequence parallelism: the model sees its whole row up to the
decoder, the decoder sees this rank's shard.

How a micro-batch goes through (every rank of a group holds the same batch):

1. The model's own forward runs as always up to its language model: token embeddings of
   the whole row, the images encoded once across the group and merged into them
   (:mod:`.vision`), the row's positions as the collator computed them.
2. A forward pre-hook on the language model pads the merged embeddings and the positions
   to a multiple of ``N`` and keeps this rank's contiguous shard (:mod:`.shard`); it hands
   every attention layer the whole row's sample boundaries and the group
   (:class:`~.ulysses.UlyssesContext`), and the layers attend across the shards through the
   Ulysses exchange (:mod:`.ulysses`), set as the language model's attention
   implementation for the step.
3. The final hidden states are this shard's; the loss takes this shard's targets (the whole
   row's labels shifted, then sliced) and returns the shard's summed loss. Summed over the
   group it is the row's loss, and the gradients summed over the group (what the data-parallel
   engines' reductions do, see the training loop) are the row's gradients.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from mmtune.training.packed_attention import language_model, model_support_problem, use_attention
from mmtune.training.sequence_parallel.groups import SPGroups, head_problems, new_groups, size_problems
from mmtune.training.sequence_parallel.shard import (pad_positions, padded_length, row_segments, shard_bounds,
                                                     shard_targets, text_positions)
from mmtune.training.sequence_parallel.ulysses import (ULYSSES_IMPLEMENTATIONS, UlyssesContext,
                                                       register_ulysses_attention)
from mmtune.training.sequence_parallel.vision import shared_image_features

__all__ = ["SequenceParallel", "setup_problems"]


def setup_problems(size: int, *, world_size: int, text_config: Any, attn_implementation: str,
                   support_problem: str = "") -> list[str]:
    """Everything that stops sequence parallelism of ``size`` (all of it, for one message).

    Args:
        size: ``training.sequence_parallel.size``.
        world_size: launched ranks.
        text_config: the language model's config (head counts).
        attn_implementation: ``model.attn_implementation``.
        support_problem: why the language model cannot swap its attention kernel
            (:func:`~mmtune.training.packed_attention.model_support_problem`), empty when it can.
    """
    problems = size_problems(size, world_size)
    if size <= 1:
        return problems
    problems += head_problems(text_config, size)
    if attn_implementation not in ULYSSES_IMPLEMENTATIONS:
        problems.append(f"model.attn_implementation={attn_implementation} cannot be split across ranks: sequence "
                        f"parallelism runs {' or '.join(ULYSSES_IMPLEMENTATIONS)} on each rank's heads (on a GPU, "
                        "sdpa's causal kernel is FlashAttention); set model.attn_implementation=sdpa")
    if support_problem:
        problems.append(support_problem)
    return problems


class SequenceParallel:
    """Sequence parallelism of one run: its groups and the step context.

    Example::

        sp = SequenceParallel.create(2, adapter, model, attn_implementation="sdpa")
        with sp.step(model, inputs, labels) as targets:
            summed = loss(model, inputs, targets, shifted=True)   # this shard's summed loss
        summed.backward()                                          # then sum gradients over the group
    """

    def __init__(self, groups: SPGroups, adapter: Any, lm: nn.Module, implementation: str):
        self.groups = groups
        self.adapter = adapter
        self.lm = lm
        self.implementation = implementation

    @classmethod
    def create(cls, size: int, adapter: Any, model: nn.Module, *, attn_implementation: str) -> "SequenceParallel":
        """Check the layout and the model, then create the groups (every rank calls this).

        Raises:
            ValueError: every problem of :func:`setup_problems`, in one message.
        """
        import torch.distributed as dist

        text_config = adapter.text_config(model.config)
        world = dist.get_world_size() if dist.is_initialized() else 1
        problems = setup_problems(size, world_size=world, text_config=text_config,
                                  attn_implementation=attn_implementation,
                                  support_problem=model_support_problem(model, text_config) if size > 1 else "")
        if problems:
            raise ValueError("training.sequence_parallel cannot run: " + "; ".join(problems))
        lm = language_model(model, text_config)
        register_ulysses_attention()
        return cls(new_groups(size), adapter, lm, ULYSSES_IMPLEMENTATIONS.get(attn_implementation, ""))

    @property
    def size(self) -> int:
        return self.groups.size

    @property
    def description(self) -> str:
        """The start-up line's words."""
        g = self.groups
        return (f"sequence parallel: {g.size} ranks per row (Ulysses exchange, {self.implementation}), "
                f"{g.dp_size} data-parallel group(s); images encoded once per group")

    @contextlib.contextmanager
    def step(self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor) -> Iterator[torch.Tensor]:
        """Run ``model``'s forward inside the block on this rank's shard of the rows; yields
        this shard's next-token targets ``[B, L'/N]`` (already shifted).

        Raises:
            ValueError: the batch carries no ``position_ids`` (the collator always sets them).
        """
        positions: Optional[torch.Tensor] = inputs.get("position_ids")
        if positions is None:
            raise ValueError("sequence parallelism needs the batch's position_ids (the collator's), to slice them")
        g = self.groups
        length = int(positions.shape[-1])
        total = padded_length(length, g.size)
        padded = pad_positions(positions, total - length)
        context = UlyssesContext(g.group, g.size, row_segments(text_positions(padded)))
        start, stop = shard_bounds(total, g.size, g.rank)

        def keep_shard(_module: nn.Module, args: tuple, kwargs: dict[str, Any]):
            embeds = kwargs.get("inputs_embeds")
            if embeds is None or args:
                raise RuntimeError(f"{type(self.lm).__name__} was called without inputs_embeds as a keyword; "
                                   "sequence parallelism shards the merged embeddings")
            if total > length:
                embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], total - length, embeds.shape[2])], 1)
            kwargs.update(inputs_embeds=embeds[:, start:stop],
                          position_ids=padded[..., start:stop].to(embeds.device),
                          # right padding of padded batches is samples of its own in the boundaries
                          attention_mask=None, sequence_parallel=context)
            return args, kwargs

        hook = self.lm.register_forward_pre_hook(keep_shard, with_kwargs=True)
        try:
            with use_attention(self.lm, self.implementation), \
                    shared_image_features(model, self.adapter, g.size, g.rank, g.group):
                yield shard_targets(labels, g.size, g.rank)
        finally:
            hook.remove()
