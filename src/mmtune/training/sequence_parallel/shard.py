"""Cutting a row into ``N`` contiguous shards: length, positions, sample boundaries, targets.

Everything here works on the *whole* row first and slices last, so a shard sees exactly
the values the one-process run computes for those tokens:

- **length**: a row of ``L`` tokens is padded at its end to ``L' = ceil(L / N) * N``
  (at most ``N - 1`` tokens); the padding is a packed sample of its own (a fresh run of
  positions ``0, 1, ...``, zero embeddings, no target), so no real token attends to it
  and it adds nothing to the loss. Shard ``r`` holds tokens ``[r L'/N, (r+1) L'/N)``.
- **positions**: the collator's ``position_ids`` (1-D running positions, or Qwen2-VL's
  ``[1 + 3, B, L]`` with M-RoPE's rows, each packed sample restarting at 0) are sliced,
  never recomputed from a shard.
- **sample boundaries**: where the plain running position does not go up by one, a new
  sample starts (the rule transformers uses for packed rows); the boundaries of the whole
  row are what every rank's attention uses after the exchange.
- **targets**: labels are shifted on the whole row (position ``t`` predicts label
  ``t + 1``) and then sliced, so the first token of shard ``r + 1`` is predicted by the
  last position of shard ``r``.
"""

from __future__ import annotations

import torch

from mmtune.models.base import IGNORE_INDEX
from mmtune.training.packed_attention import PackedSegments

__all__ = ["pad_positions", "padded_length", "row_segments", "shard_bounds", "shard_targets", "text_positions"]


def padded_length(length: int, size: int) -> int:
    """``length`` rounded up to a multiple of ``size``."""
    return -(-length // size) * size


def shard_bounds(length: int, size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of shard ``rank`` of a row of ``length`` tokens (``length`` a multiple of ``size``)."""
    if length % size:
        raise ValueError(f"a row of {length} tokens does not split into {size} equal shards; pad it first")
    step = length // size
    return rank * step, (rank + 1) * step


def text_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The plain running positions ``[B, L]`` of a batch's ``position_ids`` (``[B, L]``, or
    ``[1 + rows, B, L]`` with the running position first, see ``ModelAdapter.model_position_ids``)."""
    return position_ids if position_ids.dim() == 2 else position_ids[0]


def pad_positions(position_ids: torch.Tensor, extra: int) -> torch.Tensor:
    """``position_ids`` with ``extra`` tokens appended as a sample of their own (``0 .. extra-1`` in every row)."""
    if extra == 0:
        return position_ids
    run = torch.arange(extra, dtype=position_ids.dtype, device=position_ids.device)
    tail = run.expand(*position_ids.shape[:-1], extra)
    return torch.cat([position_ids, tail], dim=-1)


def row_segments(positions: torch.Tensor) -> PackedSegments:
    """The samples of every row of running ``positions`` ``[B, L]``: a new one wherever the
    position does not increase by one (packed samples, row padding)."""
    batch, length = positions.shape
    starts: list[list[int]] = [[0] for _ in range(batch)]
    if length > 1:
        breaks = positions[:, 1:] != positions[:, :-1] + 1
        for row, col in breaks.nonzero().tolist():
            starts[row].append(col + 1)
    return PackedSegments.from_starts(starts, length)


def shard_targets(labels: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """This shard's next-token targets ``[B, L'/N]``: the whole row's labels shifted by one,
    padded with ``IGNORE_INDEX`` to a multiple of ``size``, then sliced."""
    batch, length = labels.shape
    total = padded_length(length, size)
    targets = torch.full((batch, total), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    targets[:, :length - 1] = labels[:, 1:]
    start, stop = shard_bounds(total, size, rank)
    return targets[:, start:stop]
