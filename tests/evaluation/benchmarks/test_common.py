"""Benchmark loaders resolve image paths with the data layer's containment rule."""

import json
import re

import pytest

from mmtune.evaluation.benchmarks.common import load_mmdu_dialogues
from mmtune.evaluation.benchmarks.mdi import load_items as load_mdi
from mmtune.evaluation.benchmarks.mmvet import load_items as load_mmvet


def _bench(tmp_path, image):
    path = tmp_path / "bench" / "benchmark.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps([{"id": "d1", "image": [image], "conversations": [
        {"from": "user", "value": "<ImageHere> what?"}, {"from": "assistant", "value": "x"}]}]))
    return path


@pytest.mark.parametrize("image", ["../../etc/passwd", "/mmdu_pics/../../outside.png"])
def test_mmdu_paths_escaping_the_root_are_rejected(tmp_path, image):
    with pytest.raises(ValueError, match=r"record 'd1' \(#0\), turn 1 \(question\): \[path_outside_root\]"):
        load_mmdu_dialogues(_bench(tmp_path, image), image_root=str(tmp_path / "bench"))


def test_mmdu_absolute_path_outside_root_needs_permission(tmp_path):
    outside = tmp_path / "elsewhere.png"
    outside.write_bytes(b"x")
    path = _bench(tmp_path, str(outside))
    with pytest.raises(ValueError, match="allow_absolute_image_paths"):
        load_mmdu_dialogues(path)
    dialogue = load_mmdu_dialogues(path, allow_absolute_image_paths=True)[0]
    assert dialogue.images[0].path == str(outside)
    rooted = load_mmdu_dialogues(_bench(tmp_path, "/mmdu_pics/a.png"), image_root=str(tmp_path / "root"))[0]
    assert rooted.images[0].path == str(tmp_path / "root" / "mmdu_pics" / "a.png")


def test_mmvet_and_mdi_images_stay_inside_the_root(tmp_path):
    mmvet = tmp_path / "mm-vet.json"
    mmvet.write_text(json.dumps({"v1_0": {"question": "q", "answer": "a", "capability": ["rec"],
                                          "imagename": "../../secret.png"}}))
    with pytest.raises(ValueError, match=r"record 'v1_0' \(#0\): \[path_outside_root\]"):
        load_mmvet(str(mmvet), image_root=str(tmp_path / "images"))
    mdi = tmp_path / "mdi.json"
    mdi.write_text(json.dumps([{"question number": 1, "key": "level1-sport-old", "question": "q",
                                "option": "A. x; B. y", "answer": "A", "image_path": "../secret"}]))
    with pytest.raises(ValueError, match=r"record '1' \(#0\): \[path_outside_root\]"):
        load_mdi(str(mdi), image_root=str(tmp_path / "images"))
    mdi.write_text(mdi.read_text().replace("../secret", "sub/../inside"))
    assert load_mdi(str(mdi), image_root=str(tmp_path / "images"))[0].image == str(tmp_path / "images" / "inside.png")


def _u(v):
    return {"from": "user", "value": v}


def _a(v):
    return {"from": "assistant", "value": v}


def _ok(rid, image=None):
    return {"id": rid, "image": [image] if image else [], "conversations": [_u(("<ImageHere> " if image else "") + "Q?"),
                                                                        _a("R.")]}


# name -> (records, or raw file text; what the refusal must say). A good record goes first in
# the record cases, so the bad one is #1.
MMDU_BAD = {
    # the same id twice: its turns would be judged twice and the other dialogue's lost (the score halves)
    "duplicate id": ([_ok("d1"), _ok("d1")], r"record 'd1' \(#1\): \[duplicate_id\]"),
    # the second user turn would become the first one's reference
    "two user turns in a row": ([{"id": "d2", "conversations": [_u("a"), _u("b"), _a("c")]}],
                                r"record 'd2' \(#1\), turn 1 \(answer\): \[role_order\].*two user turns in a row"),
    "a message that is a plain string": ([{"id": "d3", "conversations": ["hello", _a("x")]}],
                                         r"record 'd3' \(#1\), turn 1 \(question\): \[malformed_record\]"),
    "a record that is no object": (["just text"], r"record '#1' \(#1\): \[malformed_record\]"),
    "a lone surrogate": ('[{"id": "d4", "conversations": [{"from": "user", "value": "bad \\ud800"}, '
                         '{"from": "assistant", "value": "x"}]}]',
                         r"record 'd4' \(#0\), turn 1 \(question\): \[lone_surrogate\].*conversations\[0\]\.value holds \\ud800"),
    "a NUL byte in an image path": ([_ok("d5", "a\u0000.png")], r"record 'd5' \(#1\), turn 1 \(question\): \[invalid_image_path\]"),
    "an image in an answer": ([{"id": "d6", "image": ["a.png"], "conversations": [_u("Q"), _a("<ImageHere>")]}],
                              r"record 'd6' \(#1\), turn 1 \(answer\): \[placeholder_in_assistant\]"),
}


@pytest.mark.parametrize("layout", ["json", "jsonl"])
@pytest.mark.parametrize("case", sorted(MMDU_BAD))
def test_mmdu_benchmark_files_are_refused_naming_file_record_and_turn(tmp_path, case, layout):
    records, expected = MMDU_BAD[case]
    path = tmp_path / f"bench.{layout}"
    if isinstance(records, str):
        text = records if layout == "json" else records[1:-1]
    else:
        records = [_ok("good")] + records if case != "duplicate id" else records
        text = json.dumps(records) if layout == "json" else "\n".join(json.dumps(r) for r in records)
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_mmdu_dialogues(path)
    message = str(err.value)
    assert message.startswith(str(path)) and re.search(expected, message), message
    assert "How to fix:" in message


def test_every_bad_record_is_listed_at_once_and_good_files_still_load(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([_ok("a"), _ok("a"), {"id": "b", "conversations": [_u("x"), _u("y"), _a("z")]}, _ok("c")]))
    with pytest.raises(ValueError, match=r"2 problem\(s\)") as err:
        load_mmdu_dialogues(path)
    assert "record 'a' (#1)" in str(err.value) and "record 'b' (#2), turn 1" in str(err.value)
    path.write_text(json.dumps([_ok("a"), _ok("b")]))
    assert [d.id for d in load_mmdu_dialogues(path)] == ["a", "b"]
    assert [d.id for d in load_mmdu_dialogues(path, limit=1)] == ["a"]


def test_images_are_checked_at_load_when_they_will_be_decoded(tmp_path):
    from PIL import Image as PILImage

    root = tmp_path / "bench"
    root.mkdir()
    PILImage.new("L", (1, 30000)).save(root / "thin.png", optimize=True)  # ~140 bytes, 1 x 30000 px
    path = root / "benchmark.json"
    path.write_text(json.dumps([_ok("d1", "thin.png"), _ok("d2", "gone.png")]))
    assert len(load_mmdu_dialogues(path)) == 2  # scoring a predictions file opens no image
    with pytest.raises(ValueError) as err:
        load_mmdu_dialogues(path, check_images="verify")
    assert re.search(r"record 'd1' \(#0\), turn 1 \(question\): \[image_too_large\].*aspect ratio of 30000:1", str(err.value))
    assert re.search(r"record 'd2' \(#1\), turn 1 \(question\): \[missing_image\]", str(err.value))


def test_a_predictions_file_may_hold_an_empty_answer(tmp_path):
    from mmtune.evaluation.benchmarks.common import load_turn_predictions

    path = tmp_path / "answers.json"
    path.write_text(json.dumps([{"id": "d1", "image": [], "conversations": [_u("Q?"), _a("")]}]))
    assert load_turn_predictions(path)[("d1", 0)].answer == ""
    with pytest.raises(ValueError, match=r"turn 1 \(answer\): \[empty_turn\]"):
        load_mmdu_dialogues(path)  # as a benchmark, an empty reference is a broken item


MMVET_BAD = {
    "duplicate id": ('{"v1_0": {"question": "q", "answer": "a", "capability": ["rec"]}, '
                     '"v1_0": {"question": "q2", "answer": "a2", "capability": ["ocr"]}}',
                     r"record 'v1_0' \(#1\): \[duplicate_id\]"),
    "a lone surrogate": ('{"v1_0": {"question": "bad \\udfff", "answer": "a", "capability": ["rec"]}}',
                         r"record 'v1_0' \(#0\): \[lone_surrogate\]"),
    "an item that is a plain string": ('{"v1_0": "what is this?"}', r"record 'v1_0' \(#0\): \[malformed_record\]"),
    "a question that is a number": ('{"v1_0": {"question": 7, "answer": "a", "capability": ["rec"]}}',
                                    r"record 'v1_0' \(#0\): \[malformed_record\].*question"),
    "a NUL byte in an image path": ('{"v1_0": {"question": "q", "answer": "a", "capability": ["rec"], '
                                    '"imagename": "a\\u0000.png"}}', r"record 'v1_0' \(#0\): \[invalid_image_path\]"),
}


@pytest.mark.parametrize("case", sorted(MMVET_BAD))
def test_mmvet_files_are_refused_naming_file_and_item(tmp_path, case):
    text, expected = MMVET_BAD[case]
    path = tmp_path / "mm-vet.json"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_mmvet(str(path))
    assert str(path) in str(err.value) and re.search(expected, str(err.value)), str(err.value)


def _mdi(number, **extra):
    return {"question number": number, "key": "level1-sport-old", "question": "q", "option": "A. x; B. y",
            "answer": "A", **extra}


MDI_BAD = {
    "duplicate id": ([_mdi(1), _mdi(1)], r"record '1' \(#1\): \[duplicate_id\]"),
    "a record that is no object": ([_mdi(1), "text"], r"record '#1' \(#1\): \[malformed_record\]"),
    "a NUL byte in an image path": ([_mdi(1, image_path="a\u0000")], r"record '1' \(#0\): \[invalid_image_path\]"),
    "a lone surrogate": ('[{"question number": 1, "key": "level1-sport-old", "question": "\\ud800", '
                         '"option": "A. x; B. y", "answer": "A"}]', r"record '#0' \(#0\): \[lone_surrogate\]"),
}


@pytest.mark.parametrize("case", sorted(MDI_BAD))
def test_mdi_files_are_refused_naming_file_and_item(tmp_path, case):
    records, expected = MDI_BAD[case]
    path = tmp_path / "mdi.json"
    path.write_text(records if isinstance(records, str) else json.dumps(records))
    with pytest.raises(ValueError) as err:
        load_mdi(str(path))
    assert str(path) in str(err.value) and re.search(expected, str(err.value)), str(err.value)
