"""Tabular inputs (mmtune.data.tables): Parquet files and shards, save_to_disk folders and JSONL
globs in every format, embedded image bytes stored by content, bad shards / rows / bytes named."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from datasets import Dataset
from PIL import Image as PILImage

from mmtune.data.check import main as data_check
from mmtune.data.config import DataConfig, MixtureConfig, SourceConfig
from mmtune.data.files import sources_from_files
from mmtune.data.readers import load_source, load_training_source
from mmtune.data.tables import input_files
from mmtune.data.validation import DataValidationError


def _text(t: str) -> dict:
    return {"type": "text", "text": t, "path": None}


def _cases(root: Path) -> dict[str, list[dict]]:
    """Two records per format, image paths relative to ``root`` (which holds pics/)."""
    two = "Image1: <ImageHere> Image2: <ImageHere> Same?"
    return {
        "llava": [{"id": f"l{i}", "image": "pics/a.png", "conversations": [
            {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": f"Red {i}."}]} for i in range(2)],
        "mmdu": [{"id": f"m{i}", "image": ["pics/a.png", "pics/c.png"], "conversations": [
            {"from": "user", "value": two}, {"from": "assistant", "value": f"No {i}."}]} for i in range(2)],
        "xcomposer2": [{"id": f"x{i}", "image": ["pics/a.png"], "conversations": [
            {"from": "user", "value": "<ImageHere> Colour?"}, {"from": "bot", "value": f"Red {i}."}]} for i in range(2)],
        "messages": [{"id": f"c{i}", "messages": [
            {"role": "user", "content": [{"type": "image", "text": None, "path": "pics/b.jpg"}, _text("Colour?")]},
            {"role": "assistant", "content": [_text(f"Green {i}.")]}]} for i in range(2)],
    }


def _write(kind: str, records: list[dict], folder: Path) -> str:
    """``records`` as a tabular input of ``kind``; returns the source path."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "parquet":
        Dataset.from_list(records).to_parquet(str(folder / "train.parquet"))
        return str(folder / "train.parquet")
    if kind == "hub_shards":  # data/train-0000k-of-00002.parquet, one record each
        (folder / "data").mkdir(exist_ok=True)
        for k, record in enumerate(records):
            Dataset.from_list([record]).to_parquet(str(folder / "data" / f"train-{k:05d}-of-00002.parquet"))
        return str(folder / "data" / "train-*.parquet")
    if kind == "save_to_disk":
        Dataset.from_list(records).save_to_disk(str(folder / "saved"))
        return str(folder / "saved")
    for k, record in enumerate(records):  # jsonl_glob
        (folder / f"part-{k}.jsonl").write_text(json.dumps(record) + "\n")
    return str(folder / "part-*.jsonl")


def _dialogues(path: str, fmt: str, root: Path, cache: Path) -> list:
    source = SourceConfig(name="s", format=fmt, path=path, image_root=str(root))
    data = DataConfig(mixture=MixtureConfig(sources=[source]), cache_dir=str(cache))
    loaded = load_training_source(source, data)
    assert loaded.report.records_skipped == 0, loaded.report.render()
    return list(loaded.dialogues)


@pytest.mark.parametrize("kind", ["parquet", "hub_shards", "save_to_disk", "jsonl_glob"])
@pytest.mark.parametrize("fmt", ["llava", "mmdu", "xcomposer2", "messages"])
def test_every_format_reads_from_every_tabular_input_as_from_json(fmt, kind, tmp_path, pics):
    records = _cases(pics.parent)[fmt]
    reference = tmp_path / "ref.json"
    reference.write_text(json.dumps(records))
    expected = _dialogues(str(reference), fmt, pics.parent, tmp_path / "c1")
    path = _write(kind, records, tmp_path / kind)
    assert _dialogues(path, fmt, pics.parent, tmp_path / "c2") == expected
    (source,), (why,) = sources_from_files([path], str(pics.parent))
    assert source.format == fmt, why


def _png(colour) -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", (8, 8), colour).save(out, format="PNG")
    return out.getvalue()


def _llava_embedded(image_bytes: list[bytes | None]) -> list[dict]:
    return [{"id": f"e{i}", "image": {"bytes": b, "path": "pics/a.png" if b is None else f"x{i}.png"},
             "conversations": [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}]}
            for i, b in enumerate(image_bytes)]


def test_embedded_images_are_stored_once_by_content_hash(tmp_path, pics):
    red, blue = _png("red"), _png("blue")
    path = _write("parquet", _llava_embedded([red, blue, red, None]), tmp_path / "p")
    dialogues = _dialogues(path, "llava", pics.parent, tmp_path / "cache")
    files = [d.images[0].path for d in dialogues]
    assert files[0] == files[2] != files[1]  # the same bytes under two names: one file
    assert files[3] == str(pics / "a.png")   # no bytes: the path column, under the image root
    import hashlib

    assert os.path.basename(files[0]) == hashlib.sha256(red).hexdigest() + ".png"
    assert Path(files[1]).read_bytes() == blue and Path(files[0]).parent == tmp_path / "cache" / "images"


def test_undecodable_bytes_are_named_by_file_row_and_column(tmp_path, pics):
    path = _write("parquet", _llava_embedded([_png("red"), b"not an image", _png("blue")]), tmp_path / "p")
    source = SourceConfig(name="s", format="llava", path=path, image_root=str(pics.parent))
    report = load_source(source, cache_dir=str(tmp_path / "c"), unique_ids=False).report
    assert (report.records_read, report.records_kept, report.skipped) == (3, 2, {"corrupt_image": 1})
    assert report.examples["corrupt_image"] == [f"e1: {path} row 1 column image: embedded bytes are no image "
                                                "(UnidentifiedImageError: cannot identify image file "
                                                f"{report.examples['corrupt_image'][0].split('image file ')[1]}"]
    with pytest.raises(DataValidationError, match=r"row 1 column image: embedded bytes are no image"):
        load_source(source, cache_dir=str(tmp_path / "c2"), mode="strict")


def test_a_broken_shard_is_named_and_skipped_or_refused(tmp_path, pics):
    records = _cases(pics.parent)["llava"]
    pattern = _write("hub_shards", records, tmp_path / "hub")
    broken = tmp_path / "hub" / "data" / "train-00001-of-00002.parquet"
    broken.write_bytes(b"PAR1 this is no parquet file")
    source = SourceConfig(name="s", format="llava", path=pattern, image_root=str(pics.parent))
    report = load_source(source, cache_dir=str(tmp_path / "c")).report
    assert (report.records_read, report.records_kept, report.skipped) == (2, 1, {"unreadable_shard": 1})
    assert str(broken) in report.examples["unreadable_shard"][0]
    with pytest.raises(DataValidationError, match="unreadable_shard"):
        load_source(source, cache_dir=str(tmp_path / "c2"), mode="strict")


def test_a_missing_column_is_the_formats_problem_with_its_row(tmp_path, pics):
    records = [{"id": "l0", "image": "pics/a.png", "text": "no conversations column"}]
    path = _write("parquet", records, tmp_path / "p")
    report = load_source(SourceConfig(name="s", format="llava", path=path, image_root=str(pics.parent)),
                         cache_dir=str(tmp_path / "c")).report
    assert report.skipped == {"malformed_record": 1} and "conversations" in report.examples["malformed_record"][0]


def test_the_cache_follows_the_shards(tmp_path, pics):
    records = _cases(pics.parent)["llava"]
    pattern = _write("hub_shards", records, tmp_path / "hub")
    source = SourceConfig(name="s", format="llava", path=pattern, image_root=str(pics.parent))
    first = load_source(source, cache_dir=str(tmp_path / "c"))
    assert load_source(source, cache_dir=str(tmp_path / "c")).cache_file == first.cache_file
    Dataset.from_list([{**records[0], "id": "new"}]).to_parquet(str(tmp_path / "hub" / "data" / "train-00002-of-00003.parquet"))
    again = load_source(source, cache_dir=str(tmp_path / "c"))
    assert again.cache_file != first.cache_file and len(again) == 3
    assert len(input_files(pattern)) == 3


def test_data_check_reads_a_parquet_glob(tmp_path, pics, capsys):
    pattern = _write("hub_shards", _cases(pics.parent)["mmdu"], tmp_path / "hub")
    code = data_check(["check", pattern, "--image-root", str(pics.parent), "--cache-dir", str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "format mmdu (detected:" in out and "records  read 2, kept 2, skipped 0" in out


def test_embedded_images_train_as_the_same_files_do(tmp_path, adapter):
    """A Parquet copy with the images embedded gives the JSON's lengths, plan and batches (pixels included)."""
    import torch

    from mmtune.data.collator import CollatorConfig
    from mmtune.data.datamodule import SFTDataModule

    folder = tmp_path / "imgs"
    folder.mkdir()
    records = []
    for i, colour in enumerate(["red", "green", "blue", "red"]):
        (folder / f"{i}.png").write_bytes(_png(colour))
        records.append({"id": f"r{i}", "image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": colour}]})
    (tmp_path / "d.json").write_text(json.dumps(records))
    embedded = [{**r, "image": {"bytes": (folder / r["image"]).read_bytes(), "path": r["image"]}} for r in records]
    parquet = _write("parquet", embedded, tmp_path / "pq")

    def served(path: str, cache: str):
        source = SourceConfig(name="s", format="llava", path=path, image_root=str(folder))
        dm = SFTDataModule(DataConfig(mixture=MixtureConfig(sources=[source]), cache_dir=str(tmp_path / cache)),
                           CollatorConfig(batching="padding", batch_size=2))
        dm.connect(adapter)
        dm.setup()
        return dm.lengths.lengths.tolist(), list(dm.dataloader(0))

    (json_lengths, json_batches), (pq_lengths, pq_batches) = served(str(tmp_path / "d.json"), "c1"), served(parquet, "c2")
    assert json_lengths == pq_lengths and len(json_batches) == len(pq_batches) == 2
    for (a, meta_a), (b, meta_b) in zip(json_batches, pq_batches):
        assert meta_a["ids"] == meta_b["ids"] and a.keys() == b.keys()
        for name in a:
            if isinstance(a[name], torch.Tensor):
                assert torch.equal(a[name], b[name]), name
