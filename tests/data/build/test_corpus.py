import json

from PIL import Image

from mmtune.data.build.corpus import read_corpus


def test_bad_entries_are_skipped_with_reasons_and_bad_images_dropped(tmp_path):
    pics = tmp_path / "pics"
    pics.mkdir()
    Image.new("RGB", (8, 8)).save(pics / "a.png")
    Image.new("RGB", (8, 8)).save(pics / "b.png")
    (pics / "broken.png").write_bytes(b"not an image")
    lines = [
        json.dumps({"id": "ok", "images": ["pics/a.png", "pics/broken.png"], "captions": ["A", "broken"], "tags": ["t"]}),
        "{not json",
        json.dumps({"id": "nocap", "images": ["pics/b.png"]}),
        json.dumps({"id": "ok", "images": ["pics/b.png"]}),
        json.dumps({"id": "gone", "images": ["pics/missing.png"]}),
        json.dumps({"id": "mismatch", "images": ["pics/a.png"], "captions": ["x", "y"]}),
        json.dumps(["a list"]),
        "",
    ]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines))
    entries, report = read_corpus(str(path))
    assert [e.id for e in entries] == ["ok", "nocap"]
    assert entries[0].images == (str(pics / "a.png"),) and entries[0].captions == ("A",)
    assert entries[1].captions == ("",)
    assert report.entries_read == 7 and report.entries_kept == 2
    assert report.skipped == {"invalid_json": 1, "duplicate_id": 1, "no_usable_image": 1, "malformed_entry": 2}
    assert report.images_dropped == {"corrupt_image": 1, "missing_image": 1}
    text = report.render()
    assert "line 2" in text and "fix:" in text


def test_image_root_and_limit(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    Image.new("RGB", (8, 8)).save(root / "a.png")
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"images": ["a.png"], "caption": "c"}) + "\n" for _ in range(3)))
    entries, report = read_corpus(str(path), image_root=str(root), check_images="exists", limit=1)
    assert len(entries) == 1 and entries[0].id == "entry-1" and entries[0].images == (str(root / "a.png"),)
    assert report.entries_read == 1
