"""The row cut into shards: padding, bounds, sample boundaries, shifted-then-sliced targets."""

import pytest
import torch

from mmtune.models.base import IGNORE_INDEX
from mmtune.training.sequence_parallel.shard import (pad_positions, padded_length, row_segments, shard_bounds,
                                                     shard_targets, text_positions)


def test_padding_and_bounds():
    assert [padded_length(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert [shard_bounds(12, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="13 tokens does not split into 2"):
        shard_bounds(13, 2, 0)


def test_padding_is_a_sample_of_its_own_and_boundaries_survive():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # three packed samples, length 9
    padded = pad_positions(positions, padded_length(9, 4) - 9)
    assert padded.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]]
    assert row_segments(padded).lengths == ((3, 2, 4, 3),)
    mrope = torch.stack([positions, positions * 0 + 7, positions * 0 + 9, positions * 0 + 11])  # [1 + 3, B, L]
    assert text_positions(mrope).tolist() == positions.tolist()
    assert pad_positions(mrope, 1)[:, 0, -1].tolist() == [0, 0, 0, 0]


def test_targets_are_shifted_on_the_whole_row_then_sliced():
    labels = torch.tensor([[IGNORE_INDEX, 11, 12, 13, 14]])
    shards = [shard_targets(labels, 2, r) for r in range(2)]
    # shard 0's last position (token 2) predicts token 3, the first token of shard 1
    assert shards[0].tolist() == [[11, 12, 13]]
    assert shards[1].tolist() == [[14, IGNORE_INDEX, IGNORE_INDEX]]
