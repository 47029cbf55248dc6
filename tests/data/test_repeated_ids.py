"""Repeated record ids in training data (llava-665k names COCO records by image): every record
is kept, cached, planned and trained once per epoch under its own key; evaluation files still
refuse them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from mmtune.data.check import main as data_check
from mmtune.data.collator import CollatorConfig
from mmtune.data.config import DataConfig, MixtureConfig, SourceConfig, ValidationConfig
from mmtune.data.datamodule import SFTDataModule
from mmtune.data.keys import RecordKeys, record_key
from mmtune.data.readers import load_source, load_training_source
from mmtune.data.stacking import stack_dialogues
from tests.data.llava_shaped import COCO_IDS, write_llava_shaped
from tests.support.processes import kill_and_resume, read_jsonl


@pytest.fixture
def llava_file(tmp_path) -> tuple[Path, list[dict]]:
    return write_llava_shaped(tmp_path / "llava")


def _data(path: Path, cache: Path, **validation) -> DataConfig:
    source = SourceConfig(name="llava_665k", format="llava", path=str(path), image_root=str(path.parent))
    return DataConfig(mixture=MixtureConfig(sources=[source]), cache_dir=str(cache),
                      validation=ValidationConfig(**validation))


def test_every_record_of_a_repeated_id_is_cached_under_its_own_key(llava_file, tmp_path):
    path, records = llava_file
    source = load_training_source(_data(path, tmp_path / "cache").mixture.sources[0], _data(path, tmp_path / "cache"))
    report = source.report
    assert (report.records_read, report.records_kept, report.records_skipped) == (len(records), len(records), 0)
    dialogues = list(source.dialogues)
    assert [d.id for d in dialogues] == [r["id"] for r in records]  # file order, nothing left out
    keys = [record_key(d) for d in dialogues]
    assert len(set(keys)) == len(keys)
    # First record of an id keeps the id as its key; a later one is id@position.
    assert keys[0] == COCO_IDS[0] and keys[4] == f"{COCO_IDS[0]}@4" and keys[20] == f"{COCO_IDS[0]}@20"
    assert keys[-1] == records[-1]["id"]
    assert Counter(d.id for d in dialogues)[COCO_IDS[0]] == 6  # 5 sub-sets + the exact duplicate
    # Random access reads the key back as iteration does.
    assert [record_key(source.dialogues[i]) for i in range(len(keys))] == keys
    # The report counts the repeats as information, with an example, and no problem.
    assert report.problems == {} and report.repeated_ids == 4 * 4 + 1 and report.exact_duplicates == 1
    rendered = report.render()
    assert "17 kept record(s) repeat an earlier record's id" in rendered
    assert f"e.g. '{COCO_IDS[0]}' at #0 and #4 (another conversation)" in rendered
    assert "1 of them exact duplicate(s)" in rendered and "problems none" in rendered


def test_exact_duplicates_are_dropped_on_request_and_counted(llava_file, tmp_path):
    path, records = llava_file
    data = _data(path, tmp_path / "cache", drop_exact_duplicates=True)
    report = load_training_source(data.mixture.sources[0], data).report
    assert (report.records_read, report.records_kept, report.records_skipped) == (len(records), len(records) - 1, 0)
    assert report.duplicates_dropped == 1 and report.repeated_ids == 16
    assert "exact duplicates dropped 1" in report.render()


def test_evaluation_files_still_refuse_repeated_ids(llava_file, tmp_path):
    """An evaluation file joins results by id: load_source's default names every repeat."""
    path, records = llava_file
    source = load_source(SourceConfig(name="eval", format="llava", path=str(path)), cache_dir=str(tmp_path / "c"))
    assert source.report.skipped == {"duplicate_id": 17} and len(source) == len(records) - 17


def test_keys_stay_unique_when_an_id_looks_like_a_generated_key():
    from mmtune.core.dialogue import Dialogue, Turn

    def d(rid: str, text: str = "q") -> Dialogue:
        return Dialogue(rid, "s", (Turn("user", (text,)), Turn("assistant", ("a",))))

    keys = RecordKeys()
    out = [keys.add(d("a@2"), 0), keys.add(d("a", "x"), 1), keys.add(d("a", "y"), 2), keys.add(d("a", "y"), 3)]
    assert [k for k, _ in out] == ["a@2", "a", "a@2@2", "a@3"] and [e for _, e in out] == [False] * 3 + [True]


def test_a_stack_is_keyed_by_its_records_keys(llava_file, tmp_path):
    path, _ = llava_file
    data = _data(path, tmp_path / "cache")
    dialogues = load_training_source(data.mixture.sources[0], data).dialogues
    assert record_key(stack_dialogues([dialogues[0], dialogues[4]])) == f"{COCO_IDS[0]}+{COCO_IDS[0]}@4"


def test_data_check_reads_as_many_as_it_keeps(llava_file, tmp_path, capsys):
    path, records = llava_file
    assert data_check(["check", str(path), "--cache-dir", str(tmp_path / "cache"), "--images", "exists"]) == 0
    out = capsys.readouterr().out
    assert f"records  read {len(records)}, kept {len(records)}, skipped 0" in out
    assert "repeat an earlier record's id" in out


def test_every_record_is_in_the_plan_and_served_once_per_epoch(llava_file, tmp_path, adapter):
    path, records = llava_file
    dm = SFTDataModule(_data(path, tmp_path / "cache"), CollatorConfig(batching="packing", batch_size=1,
                                                                       max_length=256, packing_window=8))
    dm.connect(adapter, rank=0, world_size=1, gradient_accumulation_steps=2)
    dm.setup()
    assert len(dm.lengths) == len(records) and int((dm.lengths.lengths == 0).sum()) == 0
    for epoch in (0, 1):
        planned = sorted(i for batch in dm.rank_plan(epoch).batches for row in batch for i in row)
        assert planned == list(range(len(records)))
        served = [k for _, meta in dm.dataloader(epoch) for k in meta["ids"]]
        assert sorted(served) == sorted(record_key(d) for d in dm.mixture.dialogues)


def _overrides(out: Path, path: Path, *extra: str) -> list[str]:
    return ["experiment=demo_single_image", f"training.output_dir={out}", f"synthetic.out_dir={out.parent / 'syn'}",
            f"data.cache_dir={out.parent / 'cache'}", f"data.files=[{path}]", "training.eval_before=false",
            "training.eval_after=false", "logging.progress_bar=false", "collator.batch_size=4", *extra]


@pytest.mark.slow
def test_llava_shaped_file_trains_every_record_once_per_epoch_and_resumes_exactly(llava_file, tmp_path):
    """The done-when run: a llava-665k-shaped file with repeated ids, SIGKILLed past its step-3
    checkpoint and resumed, beside the same run uninterrupted."""
    path, records = llava_file
    common = ("training.epochs=2", "training.save_every_steps=3", "training.log_sample_ids=true",
              "training.save_final=false", "training.resume=auto", "training.lr=3e-3")
    run = kill_and_resume(tmp_path, path.parent, lambda out, _data_dir, *extra: _overrides(out, path, *extra), common)
    steps, reference = read_jsonl(run.killed_dir / "sample_ids.jsonl"), read_jsonl(run.reference_dir / "sample_ids.jsonl")
    assert steps == reference and run.resume_step >= 3
    seen: set[str] = set()
    expected = []
    for i, r in enumerate(records):  # the first record of an id is keyed by it, a later one by id@position
        expected.append(f"{r['id']}@{i}" if r["id"] in seen else r["id"])
        seen.add(r["id"])
    expected.sort()
    for epoch in (0, 1):
        keys = [k for s in steps if s["epoch"] == epoch for r in s["ranks"] for mb in r["ids"] for k in mb]
        assert sorted(keys) == expected, epoch
    metrics = [json.loads(line) for line in (run.killed_dir / "metrics.jsonl").read_text().splitlines()]
    ref = {m["step"]: m["train/loss"] for m in read_jsonl(run.reference_dir / "metrics.jsonl")}
    assert [m["train/loss"] for m in metrics if m["step"] > run.resume_step] == \
        [ref[m["step"]] for m in metrics if m["step"] > run.resume_step]


@pytest.mark.parametrize("seed", range(6))
def test_keys_of_whole_arrays_equal_record_keys(seed):
    """keys_in_file_order (what a parallel read computes) gives RecordKeys' keys, counts and examples:
    ids repeated near and far, exact duplicates, records out of position order, and ids holding '@'
    (some equal to a key generated for an earlier record)."""
    import random

    import numpy as np

    from mmtune.data.keys import RecordKeys, keys_in_file_order

    rng = random.Random(seed)
    n = rng.randint(0, 300)
    pool = [f"id{k}" for k in range(rng.randint(1, 60))]
    if seed % 2:
        pool += ["id3@7", "x@1", "id1@4"]
    ids = [rng.choice(pool) for _ in range(n)]
    contents = np.array([hash((rid, rng.randint(0, 2))) for rid in ids], dtype=np.int64)
    positions = np.cumsum([rng.randint(1, 3) for _ in range(n)]).astype(np.int64) if n else np.zeros(0, np.int64)
    reference = RecordKeys(3)
    expected = [reference.add_content(rid, int(c), int(p))[0] for rid, c, p in zip(ids, contents, positions)]
    keys, repeated, exact, examples = keys_in_file_order(ids, contents, positions, 3)
    assert keys.to_pylist() == expected
    assert (repeated, exact, examples) == (reference.repeated, reference.exact, reference.examples)
