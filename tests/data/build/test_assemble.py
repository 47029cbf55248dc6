from PIL import Image

from mmtune.data.build.assemble import build_record, to_dialogue, validate_record
from mmtune.data.build.parsing import QA
from mmtune.data.build.sets import ImageSet, SetImage
from mmtune.data.validation import ImageChecker


def _set(tmp_path, n=3):
    images = []
    for k in range(n):
        p = tmp_path / f"{k}.png"
        Image.new("RGB", (8, 8)).save(p)
        images.append(SetImage(f"e{k}", str(p), f"cap {k}", ("t",), "text"))
    return ImageSet("abc", 0, tuple(images))


def test_images_enter_at_their_first_question_and_the_rest_at_the_first_cross_question(tmp_path):
    s = _set(tmp_path)
    per_image = [[QA("About Image1?", "A1"), QA("More?", "A2")], [], [QA("About Image3?", "A3")]]
    cross = [QA("Compare Image1 and Image2.", "C1"), QA("And Image3?", "C2")]
    rec = build_record(s, per_image, cross)
    users = [m["value"] for m in rec["conversations"] if m["from"] == "user"]
    assert users == ["Image1: <ImageHere>\nAbout Image1?", "More?", "Image3: <ImageHere>\nAbout Image3?",
                     "Image2: <ImageHere>\nCompare Image1 and Image2.", "And Image3?"]
    assert rec["image"] == [s.images[0].path, s.images[2].path, s.images[1].path]
    assert validate_record(rec, ImageChecker("verify")) == []
    d = to_dialogue(rec)
    assert [im.path for im in d.images] == rec["image"] and len(d.turns) == 10


def test_an_image_no_question_is_about_is_left_out(tmp_path):
    s = _set(tmp_path, 2)
    rec = build_record(s, [[QA("Q?", "A")], []], [])
    assert rec["image"] == [s.images[0].path]


def test_validation_reports_what_the_reader_would_reject(tmp_path):
    s = _set(tmp_path, 2)
    rec = build_record(s, [[QA("Q?", "A")], [QA("Q2?", "A2")]], [])
    rec["conversations"][1]["value"] = "   "
    assert [p.code for p in validate_record(rec)] == ["empty_turn"]
    rec["image"].append("/nowhere.png")
    assert [p.code for p in validate_record(rec)] == ["placeholder_mismatch"]
    rec = build_record(s, [[QA("Q?", "A")], [QA("Q2?", "A2")]], [])
    rec["image"][1] = str(tmp_path / "gone.png")
    assert [p.code for p in validate_record(rec, ImageChecker("exists"))] == ["missing_image"]
