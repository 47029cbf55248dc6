import json
import os

import pytest

from mmtune.data.config import SourceConfig
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.readers import load_source, read_datatxt, sources_from_datatxt
from mmtune.data.validation import DataValidationError


@pytest.fixture
def load(tmp_path, cache_dir, write_json, write_jsonl):
    """``load(fmt, records, name=..., jsonl=False, **source_cfg)`` in strict mode."""

    def _load(fmt, records, name="src", jsonl=False, **cfg):
        return _load_impl(tmp_path, cache_dir, write_json, write_jsonl, fmt, records, name, jsonl, **cfg)

    return _load


def _load_impl(tmp_path, cache_dir, write_json, write_jsonl, fmt, records, name, jsonl, **cfg):
    path = (write_jsonl if jsonl else write_json)(tmp_path / f"{name}.{'jsonl' if jsonl else 'json'}", records)
    return load_source(SourceConfig(name=name, format=fmt, path=str(path), **cfg), cache_dir=cache_dir, mode="strict")


def test_llava_image_positions_and_text_only(tmp_path, pics, cache_dir, load):
    records = [
        {"id": "start", "image": "a.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "Red."}]},
        {"id": "end", "image": "b.jpg", "conversations": [
            {"from": "human", "value": "What colour?\n<image>"}, {"from": "gpt", "value": "Green."},
            {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]},
        {"id": "text", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
    ]
    src = load("llava", records, image_root=str(pics))
    d = {x.id: x for x in src.dialogues}
    a, b = str(pics / "a.png"), str(pics / "b.jpg")
    assert d["start"].turns[0] == Turn("user", (Image(a), "\nWhat colour?"))
    assert d["start"].turns[1] == Turn("assistant", ("Red.",))
    # by default <image> goes to the front of its (stripped) turn, as LLaVA-1.5's preprocessing
    assert d["end"].turns[0] == Turn("user", (Image(b), "\nWhat colour?"))
    assert [t.role for t in d["end"].turns] == ["user", "assistant", "user", "assistant"]
    assert d["text"].images == ()
    assert (src.report.records_kept, src.report.images, src.report.text_only, src.report.turns) == (3, 2, 1, 8)
    assert src.dialogues[0].source == "src"

    kept = load("llava", records, name="kept", image_root=str(pics), move_image_to_start=False)
    assert kept.dialogues[1].turns[0] == Turn("user", ("What colour?\n", Image(b)))


def test_mmdu_images_introduced_in_later_turns(tmp_path, pics, cache_dir, load):
    record = {
        "id": "m1",
        "image": ["a.png", "b.jpg", "c.png"],
        "conversations": [
            {"from": "user", "value": "Image1: <ImageHere>. Image2: <ImageHere>. Compare them."},
            {"from": "assistant", "value": "Image1 is red, Image2 is green."},
            {"from": "user", "value": "And Image1 again?"},
            {"from": "assistant", "value": "Red."},
            {"from": "user", "value": "Image3: <ImageHere>. What about Image3?"},
            {"from": "assistant", "value": "Blue."},
        ],
    }
    src = load("mmdu", [record], image_root=str(pics))
    d = src.dialogues[0]
    assert d.turns[0].segments == ("Image1: ", Image(str(pics / "a.png")), ". Image2: ", Image(str(pics / "b.jpg")), ". Compare them.")
    assert d.turns[2].segments == ("And Image1 again?",)
    assert d.turns[4].segments == ("Image3: ", Image(str(pics / "c.png")), ". What about Image3?")
    assert [i.path for i in d.images] == [str(pics / n) for n in ("a.png", "b.jpg", "c.png")]
    assert list(d.exchanges()) == [(0, 1), (2, 3), (4, 5)]


def test_mmdu_benchmark_paths_resolve_against_image_root(tmp_path, pics, cache_dir, load):
    (tmp_path / "bench" / "mmdu_pics").mkdir(parents=True)
    os.link(pics / "a.png", tmp_path / "bench" / "mmdu_pics" / "x.png")
    record = {"id": 7, "image": ["/mmdu_pics/x.png"], "conversations": [
        {"from": "user", "value": "Image1: <ImageHere>. What?"}, {"from": "assistant", "value": "Red."}]}
    src = load("mmdu", [record], image_root=str(tmp_path / "bench"))
    assert src.dialogues[0].images == (Image(str(tmp_path / "bench" / "mmdu_pics" / "x.png")),)
    assert src.dialogues[0].id == "7"
    stripped = load("mmdu", [record], name="stripped",
                     image_root=str(tmp_path / "bench" / "mmdu_pics"), strip_image_prefix="/mmdu_pics/")
    assert stripped.dialogues[0].images == src.dialogues[0].images


def test_relative_paths_default_to_the_data_file_folder(tmp_path, pics, cache_dir, load):
    record = {"id": "r", "image": ["pics/a.png"], "conversations": [
        {"from": "user", "value": "<ImageHere> ?"}, {"from": "assistant", "value": "red"}]}
    src = load("mmdu", [record])
    assert src.dialogues[0].images == (Image(str(pics / "a.png")),)


def test_xcomposer2_roles_and_datatxt(tmp_path, pics, cache_dir, load):
    record = {"id": "x", "image": [str(pics / "a.png")], "conversations": [
        {"from": "human", "value": "<ImageHere>Describe."}, {"from": "bot", "value": "Red square."},
        {"from": "user", "value": "More?"}, {"from": "gpt", "value": "No."}]}
    src = load("xcomposer2", [record])
    d = src.dialogues[0]
    assert [t.role for t in d.turns] == ["user", "assistant", "user", "assistant"]
    assert d.turns[0].segments == (Image(str(pics / "a.png")), "Describe.")

    (tmp_path / "data.txt").write_text(f"# comment\nsrc.json 0.5\n{tmp_path}/other.json 2\n\n")
    assert read_datatxt(str(tmp_path / "data.txt")) == [(str(tmp_path / "src.json"), 0.5), (f"{tmp_path}/other.json", 2.0)]
    sources = sources_from_datatxt(str(tmp_path / "data.txt"), image_root=str(pics))
    assert [(s.format, s.num_samples, s.image_root) for s in sources] == [("xcomposer2", 500, str(pics)), ("xcomposer2", 2000, str(pics))]
    (tmp_path / "bad.txt").write_text("src.json\n")
    with pytest.raises(DataValidationError, match="bad.txt:1"):
        read_datatxt(str(tmp_path / "bad.txt"))


def test_messages_jsonl_interleaved_parts(tmp_path, pics, cache_dir, load):
    records = [
        {"id": "chat1", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "text", "text": "First "},
                {"type": "image_url", "image_url": {"url": "a.png"}},
                {"type": "text", "text": " then "},
                {"type": "image", "image": f"file://{pics}/b.jpg"},
                {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "Red, green."}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "path": "c.png"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}]},
    ]
    src = load("messages", records, jsonl=True, image_root=str(pics))
    d0, d1 = src.dialogues[0], src.dialogues[1]
    assert d0.turns[0] == Turn("system", ("Be brief.",))
    assert d0.turns[1].segments == ("First ", Image(str(pics / "a.png")), " then ", Image(str(pics / "b.jpg")), "?")
    assert list(d0.exchanges()) == [(1, 2)]
    assert d1.id == "src-1" and d1.turns[0].segments == (Image(str(pics / "c.png")),)


def test_dialogue_sequence_is_random_access_and_lazy(tmp_path, pics, cache_dir, load):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
               for i in range(2500)]
    src = load("llava", records)
    seq = src.dialogues
    assert len(seq) == 2500 and len(src) == 2500
    assert seq[1234].id == "r1234" and seq[-1].id == "r2499"
    assert [d.id for d in seq[10:13]] == ["r10", "r11", "r12"]
    assert [d.id for d in seq] == [f"r{i}" for i in range(2500)]
    assert isinstance(seq[0], Dialogue)
    with pytest.raises(IndexError):
        seq[2500]
    assert src.num_chars[5] == len("q5") + len("a5")
    assert src.estimated_tokens(576)[5] == 1
    assert src.cache_file.endswith(".arrow")
