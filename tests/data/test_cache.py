import os

import pytest

from mmtune.data import readers
from mmtune.data.cache import FEATURES, CacheWriter, cache_key, entry_paths, open_entry
from mmtune.data.config import SourceConfig
from mmtune.data.readers import load_source


def _records(n):
    return [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(n)]


def _forbid_parsing(monkeypatch):
    def boom(path, *limit):
        raise AssertionError("the data file was parsed although a cache entry exists")

    monkeypatch.setattr(readers, "iter_records", boom)


def test_second_load_reads_the_cache_not_the_file(tmp_path, cache_dir, write_json, monkeypatch):
    path = write_json(tmp_path / "d.json", _records(20))
    cfg = SourceConfig(name="s", format="llava", path=str(path))
    first = load_source(cfg, cache_dir=cache_dir)
    _forbid_parsing(monkeypatch)
    second = load_source(cfg, cache_dir=cache_dir)
    assert second.cache_file == first.cache_file
    assert [d.id for d in second.dialogues] == [d.id for d in first.dialogues]
    assert second.report == first.report
    with pytest.raises(AssertionError, match="parsed"):
        load_source(cfg, cache_dir=cache_dir, refresh=True)


def test_key_changes_with_file_and_reader_options(tmp_path, cache_dir, write_json):
    path = write_json(tmp_path / "d.json", _records(3))
    cfg = SourceConfig(name="s", format="llava", path=str(path))
    a = load_source(cfg, cache_dir=cache_dir)
    assert load_source(cfg, cache_dir=cache_dir, check_images="exists").cache_file != a.cache_file
    assert load_source(cfg, cache_dir=cache_dir, max_record_bytes=1 << 20).cache_file != a.cache_file
    assert load_source(SourceConfig(name="s", format="llava", path=str(path), image_root=str(tmp_path)),
                       cache_dir=cache_dir).cache_file != a.cache_file
    write_json(path, _records(5))
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse-clock file systems
    b = load_source(cfg, cache_dir=cache_dir)
    assert b.cache_file != a.cache_file and len(b.dialogues) == 5
    assert cache_key(str(path), {"x": 1}) == cache_key(str(path), {"x": 1}) != cache_key(str(path), {"x": 2})


def test_interrupted_build_leaves_no_entry(tmp_path, cache_dir, write_json, monkeypatch):
    path = write_json(tmp_path / "d.json", _records(3))
    cfg = SourceConfig(name="s", format="llava", path=str(path))

    def interrupted(path, *limit):
        yield 0, _records(1)[0], None
        raise KeyboardInterrupt

    monkeypatch.setattr(readers, "iter_records", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_source(cfg, cache_dir=cache_dir)
    assert os.listdir(cache_dir) == []
    monkeypatch.undo()
    assert len(load_source(cfg, cache_dir=cache_dir).dialogues) == 3


def test_writer_roundtrip(tmp_path):
    arrow, report = entry_paths(str(tmp_path), "my source/x", "k")
    assert os.path.basename(arrow) == "my_source_x-k.arrow"
    assert open_entry(arrow, report) is None
    w = CacheWriter(arrow, report, batch_size=2)
    rows = [{"id": str(i), "key": f"{i}@{i}", "source": "s", "roles": ["user"], "segments": [[{"text": "t", "image": None}]],
             "num_images": 0, "num_chars": 1} for i in range(5)]
    for r in rows:
        w.add(r)
    w.commit({"hello": 1})
    ds, rep = open_entry(arrow, report)
    assert rep == {"hello": 1} and ds.num_rows == 5 and ds[4] == rows[4]
    assert set(ds.features) == set(FEATURES)


def test_batched_iteration_equals_reading_row_by_row(tmp_path, cache_dir, write_json):
    """Iteration converts 1000-row Arrow batches column by column; it must give exactly the
    dialogues of the row-by-row path, across batch edges, for selected (re-indexed) rows and
    for every segment shape (text, image, adjacent images, system turns, empty text)."""
    import random

    from mmtune.data.dialogue import Dialogue
    from mmtune.data.readers import DialogueSequence

    rng = random.Random(0)
    records = []
    for i in range(2345):
        images, turns = [], []
        if rng.random() < 0.2:
            turns.append({"from": "system", "value": "Be brief."})
        for t in range(rng.randint(1, 4)):
            k = rng.choice([0, 0, 1, 2])
            text = " ".join(["<ImageHere>"] * k) + rng.choice(["", " What is this?", "Compare them."])
            images += [f"img_{i}_{t}_{j}.png" for j in range(k)]
            turns += [{"from": "user", "value": text or "Hi"}, {"from": "assistant", "value": f"answer {i}.{t}"}]
        records.append({"id": f"d{i}", "image": images, "conversations": turns})
    path = write_json(tmp_path / "mmdu.json", records)
    source = load_source(SourceConfig(name="s", format="mmdu", path=str(path)), cache_dir=cache_dir,
                         check_images="none")
    assert source.report.records_kept == 2345, source.report
    dataset = source.dialogues.dataset
    one_by_one = [Dialogue.from_record(dataset[i]) for i in range(dataset.num_rows)]
    assert list(source.dialogues) == one_by_one and len(one_by_one) == 2345
    assert source.dialogues.read_range(990, 1013) == one_by_one[990:1013]  # what the length pass reads
    assert [d.meta["key"] for d in source.dialogues.read_range(0, 3)] == ["d0", "d1", "d2"]
    assert sum(d.num_images for d in one_by_one) == sum(len(r["image"]) for r in records)
    order = rng.sample(range(dataset.num_rows), 1500)
    assert list(DialogueSequence(dataset.select(order))) == [one_by_one[i] for i in order]


def test_the_records_fingerprint_is_the_same_for_every_rank_that_built_the_entry(tmp_path, cache_dir, write_json):
    """Ranks that each built the same entry (same content, other times) must key the length cache alike."""
    path = write_json(tmp_path / "d.json", _records(4))
    cfg = SourceConfig(name="s", format="llava", path=str(path))
    first = load_source(cfg, cache_dir=cache_dir)
    os.utime(first.cache_file, ns=(1, 1))  # another rank's rename of the same bytes
    again = load_source(cfg, cache_dir=cache_dir)
    assert again.dialogues.fingerprint == first.dialogues.fingerprint
    other = load_source(SourceConfig(name="s", format="llava", path=str(write_json(tmp_path / "e.json", _records(5)))),
                        cache_dir=cache_dir)
    assert other.dialogues.fingerprint != first.dialogues.fingerprint
