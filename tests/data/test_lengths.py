"""Length pass: exact (equals the encoded length), no pixel access, cached by fingerprint + settings."""

import os

import numpy as np

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import encode_example
from mmtune.data.lengths import compute_lengths, dataset_fingerprint
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter


def _dialogues(n=40):
    rng = np.random.default_rng(1)
    out = []
    for d in range(n):
        turns = []
        for t in range(int(rng.integers(1, 7))):
            segments = [f"Image{k}: " if k % 2 else Image(f"/nowhere/{d}_{t}_{k}.jpg") for k in range(int(rng.integers(0, 3)) * 2)]
            segments.append("What colour is the shape? " * int(rng.integers(1, 20)))
            turns += [Turn("user", tuple(segments)), Turn("assistant", ("It is red. " * int(rng.integers(1, 40)),))]
        out.append(Dialogue(f"d{d}", "t", tuple(turns)))
    return out


def test_lengths_equal_encoded_lengths_without_touching_images(adapter_576):
    dialogues = _dialogues()
    # every image path is missing: a length pass that opened files would fail
    table = compute_lengths(adapter_576, dialogues, max_length=4096, chunk_size=7)
    for d, length, n_img, full in zip(dialogues, table.lengths, table.num_images, table.full_lengths):
        example = encode_example(adapter_576, d, max_length=4096)
        if example is None:
            assert length == 0
        else:
            assert length == len(example) and n_img == len(example.images)
        assert full == len(encode_example(adapter_576, d, max_length=None))
    assert table.stats["truncated"] > 0
    assert table.stats["samples"] == len(dialogues)


def test_cache_is_keyed_by_data_and_settings(adapter_576, tmp_path):
    dialogues = _dialogues(10)
    first = compute_lengths(adapter_576, dialogues, max_length=2048, cache_dir=str(tmp_path))
    assert not first.from_cache and os.path.exists(tmp_path / f"lengths-{first.key}.npz")
    again = compute_lengths(adapter_576, dialogues, max_length=2048, cache_dir=str(tmp_path))
    assert again.from_cache and np.array_equal(again.lengths, first.lengths) and again.stats == first.stats
    other_budget = compute_lengths(adapter_576, dialogues, max_length=4096, cache_dir=str(tmp_path))
    assert not other_budget.from_cache and other_budget.key != first.key
    changed = dialogues[:9] + [Dialogue("new", "t", (Turn("user", ("q",)), Turn("assistant", ("a",))))]
    assert dataset_fingerprint(changed) != dataset_fingerprint(dialogues)
    assert not compute_lengths(adapter_576, changed, max_length=2048, cache_dir=str(tmp_path)).from_cache
    small = build_adapter(ModelConfig(family="llava"))  # 16 image tokens: another adapter fingerprint
    assert compute_lengths(small, dialogues, max_length=2048, cache_dir=str(tmp_path)).key != first.key


def test_worker_processes_give_the_same_table(adapter_576):
    dialogues = _dialogues(30)
    one = compute_lengths(adapter_576, dialogues, max_length=2048, chunk_size=4)
    two = compute_lengths(adapter_576, dialogues, max_length=2048, chunk_size=4, num_proc=2)
    assert np.array_equal(one.lengths, two.lengths) and np.array_equal(one.num_images, two.num_images)
    assert one.stats == two.stats


class _RenderOnly:
    """An adapter with only the base contract (no batched encode / measure fast paths)."""

    family = "render_only"

    def __init__(self, inner):
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.image_token_id = inner.image_token_id

    def encode_dialogue(self, dialogue, **kwargs):
        return self.inner.encode_dialogue(dialogue, **kwargs)


def test_generic_path_equals_the_fast_path(adapter_576):
    dialogues = _dialogues(25)
    fast = compute_lengths(adapter_576, dialogues, max_length=3000)
    generic = compute_lengths(_RenderOnly(adapter_576), dialogues, max_length=3000)
    assert np.array_equal(fast.lengths, generic.lengths) and np.array_equal(fast.full_lengths, generic.full_lengths)
    assert np.array_equal(fast.num_images, generic.num_images) and fast.stats == generic.stats
