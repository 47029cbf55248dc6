"""Sharing a row's images among the ranks of a group, balanced by their size."""

from mmtune.training.sequence_parallel.vision import share_images


def test_largest_first_to_the_least_loaded_rank():
    shares = share_images([100, 10, 60, 50, 5], 2)
    assert shares == [[0, 1, 4], [2, 3]]  # loads 115 and 110
    assert sorted(i for s in shares for i in s) == list(range(5))
    assert share_images([7], 3) == [[0], [], []]
    assert share_images([], 2) == [[], []]


def test_image_inputs_split_one_image_at_a_time():
    import torch

    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    qwen = build_adapter(ModelConfig(family="qwen2_vl"))
    grid = torch.tensor([[1, 2, 2], [1, 4, 2]])
    inputs = {"pixel_values": torch.arange(12 * 3.0).reshape(12, 3), "image_grid_thw": grid}
    pieces = qwen.split_image_inputs(inputs)
    assert [p["pixel_values"].shape[0] for p in pieces] == [4, 8]
    assert [p["image_grid_thw"].tolist() for p in pieces] == [[[1, 2, 2]], [[1, 4, 2]]]
    for name in inputs:
        assert torch.equal(torch.cat([p[name] for p in pieces]), inputs[name])
    llava = build_adapter(ModelConfig(family="llava"))
    square = {"pixel_values": torch.zeros(3, 3, 8, 8)}
    assert [p["pixel_values"].shape for p in llava.split_image_inputs(square)] == [(1, 3, 8, 8)] * 3
