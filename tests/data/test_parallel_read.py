"""A source read on several processes (mmtune.data.parallel_read) gives the cache entry, the
report and the strict-mode error that one process gives: for JSON lists, JSONL files with
blank and broken lines, and Parquet shards; with repeated ids and records skipped for
every kind of problem, in blocks small enough that every worker reads several."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset
from PIL import Image as PILImage

import mmtune.data.parallel_read as parallel_read
from mmtune.data.config import SourceConfig
from mmtune.data.readers import load_source
from mmtune.data.validation import DataValidationError


@pytest.fixture(autouse=True)
def parallel_reads(monkeypatch) -> list[int]:
    """Every input read in parallel, in blocks of 3 records; the worker counts of the parallel reads."""
    monkeypatch.setattr(parallel_read, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(parallel_read, "BLOCK", 3)
    calls: list[int] = []
    inner = parallel_read.read_in_parallel

    def counted(job, *args, **kwargs):
        calls.append(job.workers)
        return inner(job, *args, **kwargs)

    monkeypatch.setattr(parallel_read, "read_in_parallel", counted)
    return calls


def _records(root: Path, n: int, bad: bool) -> list:
    """llava records: ids repeated (every 4th record repeats an earlier id, some exactly), and
    with ``bad`` every kind of skipped record (missing image, no answer, not an object, an
    image outside the root)."""
    (root / "pics").mkdir(parents=True, exist_ok=True)
    PILImage.new("RGB", (8, 8), (200, 10, 10)).save(root / "pics" / "a.png")
    records: list = []
    for i in range(n):
        rid = f"r{i - 3}" if i % 4 == 3 else f"r{i}"
        record = {"id": rid, "image": "pics/a.png", "conversations": [
            {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": f"Red {i}."}]}
        if i % 8 == 7:  # an exact duplicate of the record three before
            record = json.loads(json.dumps(records[i - 3]))
        elif bad and i % 7 == 2:
            record["image"] = f"pics/missing{i}.png"
        elif bad and i % 11 == 5:
            record["conversations"] = record["conversations"][:1]
        elif bad and i % 13 == 6:
            record = ["not", "an", "object"]
        elif bad and i % 17 == 8:
            record["image"] = "../outside.png"
        records.append(record)
    return records


def _write(kind: str, records: list, root: Path) -> str:
    if kind == "json":
        path = root / "data.json"
        path.write_text(json.dumps(records, indent=1))
    elif kind in ("jsonl", "jsonl_shards"):  # blank, broken and too long lines between the records
        lines = []
        for i, record in enumerate(records):
            lines.append(json.dumps(record))
            if i % 9 == 4:
                lines.append("")
            if i % 10 == 6:
                lines.append('{"id": "broken", ')
            if i % 19 == 9:
                lines.append(json.dumps({"id": f"long{i}", "conversations": [{"from": "human", "value": "x" * 3000}]}))
        if kind == "jsonl":
            path = root / "data.jsonl"
            path.write_text("\n".join(lines) + "\n")
        else:
            (root / "parts").mkdir()
            for k in range(3):
                (root / "parts" / f"part-{k}.jsonl").write_text("\n".join(lines[k::3]) + "\n")
            return str(root / "parts" / "part-*.jsonl")
    else:  # Parquet shards, the images embedded as bytes with "parquet_embedded"
        (root / "shards").mkdir()
        objects = [r for r in records if isinstance(r, dict)]
        if kind == "parquet_embedded":
            objects = [{**r, "image": {"bytes": (root / r["image"]).read_bytes() if (root / r["image"]).is_file()
                                       else b"no image", "path": r["image"]}} for r in objects]
        half = len(objects) // 2
        for k, part in enumerate((objects[:half], objects[half:])):
            Dataset.from_list(part).to_parquet(str(root / "shards" / f"train-{k:05d}-of-00002.parquet"))
        return str(root / "shards" / "train-*.parquet")
    return str(path)


def _rows(loaded, cache: Path) -> str:
    """The entry's rows, the cache folder (where embedded images are stored) written as ``<cache>``."""
    return json.dumps(loaded.dialogues.dataset.data.table.to_pylist()).replace(str(cache), "<cache>")


def _load(path: str, root: Path, cache: Path, num_proc: int, **options):
    """The source read through the cache; JSONL lines over 2,000 bytes are ``record_too_large``."""
    source = SourceConfig(name="s", format="llava", path=path, image_root=str(root))
    return load_source(source, cache_dir=str(cache), unique_ids=False, num_proc=num_proc, max_record_bytes=2000,
                       **options)


@pytest.mark.parametrize("kind", ["json", "jsonl", "jsonl_shards", "parquet", "parquet_embedded"])
@pytest.mark.parametrize("bad", [False, True])
def test_entry_and_report_do_not_depend_on_the_processes(kind, bad, tmp_path, parallel_reads):
    path = _write(kind, _records(tmp_path, 61, bad), tmp_path)
    one = _load(path, tmp_path, tmp_path / "c1", 1)
    assert len(one) > 20 and one.report.repeated_ids > 5 and one.report.exact_duplicates > 0
    if bad or kind.startswith("jsonl"):
        assert len(one.report.skipped) >= 2, one.report.render()
    if kind.startswith("jsonl"):
        assert {"record_too_large", "invalid_json"} <= set(one.report.skipped), one.report.render()
    for workers in (2, 3):
        many = _load(path, tmp_path, tmp_path / f"c{workers}", workers)
        assert _rows(many, tmp_path / f"c{workers}") == _rows(one, tmp_path / "c1")
        assert many.report.to_dict() == one.report.to_dict()
        assert not list((tmp_path / f"c{workers}").glob("*.part*")), "a worker's shard was left behind"
    assert parallel_reads == [2, 3]


@pytest.mark.parametrize("kind", ["json", "jsonl"])
def test_strict_mode_names_the_first_problem_of_the_file(kind, tmp_path, parallel_reads):
    path = _write(kind, _records(tmp_path, 40, True), tmp_path)
    with pytest.raises(DataValidationError) as one:
        _load(path, tmp_path, tmp_path / "c1", 1, mode="strict")
    with pytest.raises(DataValidationError) as many:
        _load(path, tmp_path, tmp_path / "c2", 3, mode="strict")
    assert str(many.value) == str(one.value) and parallel_reads == [3]
    assert not list((tmp_path / "c2").iterdir()), "a strict failure left a cache entry or shard"


def test_dropping_exact_duplicates_reads_on_one_process_and_gives_the_same_entry(tmp_path, parallel_reads):
    path = _write("json", _records(tmp_path, 30, False), tmp_path)
    one = _load(path, tmp_path, tmp_path / "c1", 1, drop_exact_duplicates=True)
    many = _load(path, tmp_path, tmp_path / "c2", 2, drop_exact_duplicates=True)
    assert one.report.duplicates_dropped > 0 and parallel_reads == []
    assert many.dialogues.dataset.data.table.equals(one.dialogues.dataset.data.table)
    assert many.report.to_dict() == one.report.to_dict()


def test_a_broken_json_list_fails_as_on_one_process(tmp_path, parallel_reads):
    path = tmp_path / "data.json"
    records = _records(tmp_path, 20, False)
    path.write_text(json.dumps(records)[:-40])
    with pytest.raises(DataValidationError) as one:
        _load(str(path), tmp_path, tmp_path / "c1", 1)
    with pytest.raises(DataValidationError) as many:
        _load(str(path), tmp_path, tmp_path / "c2", 2)
    assert str(many.value) == str(one.value) and parallel_reads == [2]


@pytest.mark.parametrize("text", ["[]", "", "\n\n"])
def test_an_empty_source_gives_an_empty_entry(text, tmp_path, parallel_reads):
    path = tmp_path / ("data.json" if text == "[]" else "data.jsonl")
    path.write_text(text)
    loaded = _load(str(path), tmp_path, tmp_path / "c", 2)
    assert len(loaded) == 0 and loaded.report.records_read == 0 and parallel_reads == [2]
