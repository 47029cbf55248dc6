"""Sharing a row's images among the ranks of a group, balanced by their size."""

from mmtune.training.sequence_parallel.vision import share_images


def test_largest_first_to_the_least_loaded_rank():
    shares = share_images([100, 10, 60, 50, 5], 2)
    assert shares == [[0, 1, 4], [2, 3]]  # loads 115 and 110
    assert sorted(i for s in shares for i in s) == list(range(5))
    assert share_images([7], 3) == [[0], [], []]
    assert share_images([], 2) == [[], []]
