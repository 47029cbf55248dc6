"""Length pass: exact (equals the encoded length), no pixel access, cached by fingerprint + settings."""

import os

import numpy as np
import pytest

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


def _qwen_dialogues(paths):
    return [Dialogue(f"q{k}", "t", (Turn("user", ("Look: ", Image(str(p)), " what colour?")),
                                    Turn("assistant", ("red",)), Turn("user", ("Sure?",)), Turn("assistant", ("yes",))))
            for k, p in enumerate(paths)]


def test_a_changed_image_under_the_same_path_is_measured_again(tmp_path, monkeypatch):
    """The 553-token case: images grew from 56 to 448 px under the same paths after the lengths
    were cached; the stored entries of exactly those records are measured again, so no sample
    is planned longer than the window."""
    from PIL import Image as PILImage

    from mmtune.data import lengths as lengths_module

    def launch():  # a new adapter each time, as a new launch builds one (it remembers image headers by path)
        return build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": "qwen2_vl"}))

    paths = [tmp_path / f"{k}.png" for k in range(3)]
    for p in paths:
        PILImage.new("RGB", (56, 56), "red").save(p)
    dialogues = _qwen_dialogues(paths)
    cache = str(tmp_path / "lengths")
    settings = dict(max_length=100, cache_dir=cache, fingerprint="three-dialogues")
    before = compute_lengths(launch(), dialogues, **settings)
    assert not before.from_cache and before.full_lengths.max() <= 100 and before.stats["truncated"] == 0
    os.utime(paths[1], ns=(1, 1))  # a different time alone: measured again, same length
    big = PILImage.new("RGB", (448, 448), "red")
    big.save(paths[2])

    measured = []
    real = lengths_module._lengths_of_range

    def counting(adapter, subset, bounds, **kw):
        measured.append([subset[i].id for i in range(*bounds)])
        return real(adapter, subset, bounds, **kw)

    monkeypatch.setattr(lengths_module, "_lengths_of_range", counting)
    after = compute_lengths(launch(), dialogues, **settings)
    assert after.from_cache and measured == [["q1", "q2"]]
    fresh = compute_lengths(launch(), dialogues, max_length=100)
    assert after.lengths.tolist() == fresh.lengths.tolist() and after.stats == fresh.stats
    assert after.full_lengths[2] > 100 >= after.lengths.max()  # the grown image's sample is cut to the window
    assert after.lengths[:2].tolist() == before.lengths[:2].tolist()
    assert after.stats["truncated"] + after.stats["skipped"] == 1
    # Stored again: a third launch measures nothing.
    measured.clear()
    assert compute_lengths(launch(), dialogues, **settings).lengths.tolist() == fresh.lengths.tolist()
    assert measured == []


@pytest.mark.slow
def test_two_ranks_share_one_length_pass(tmp_path, adapter_576):
    """Each rank measures every other chunk; both get the whole table, equal to one process's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(repo / "tests" / "data" / "length_ranks_worker.py")]
    procs = [subprocess.Popen([*cmd, str(r), "2", str(tmp_path / "init"), str(tmp_path / "cache"),
                               str(tmp_path / f"rank{r}.json")], env=env) for r in (0, 1)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    chunks = [(start, min(40, start + 7)) for start in range(0, 40, 7)]
    assert [list(map(tuple, r["measured"])) for r in ranks] == [chunks[0::2], chunks[1::2]]
    single = compute_lengths(adapter_576, _dialogues(), max_length=4096, chunk_size=7)
    assert ranks[0]["lengths"] == ranks[1]["lengths"] == single.lengths.tolist()
    assert ranks[0]["stats"] == ranks[1]["stats"] == single.stats
    # Stored once for the next launch, the part files gone.
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [next((tmp_path / "cache").glob("lengths-*.npz")).name]


@pytest.mark.slow
def test_a_rank_that_stops_stops_every_rank(tmp_path):
    """Strict mode on one rank's share (here: any error) stops the others too, naming it, instead
    of leaving them at the barrier."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(repo / "tests" / "data" / "length_ranks_worker.py")]
    procs = [subprocess.Popen([*cmd, str(r), "2", str(tmp_path / "init"), str(tmp_path / "cache"),
                               str(tmp_path / f"rank{r}.json"), "1"], env=env) for r in (0, 1)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[1]["error"] == "ValueError: rank 1 cannot measure (7, 14)"
    assert ranks[0]["error"] == "RuntimeError: the length pass stopped on rank 1: ValueError: rank 1 cannot measure (7, 14)"
