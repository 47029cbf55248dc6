"""Benchmark loaders resolve image paths with the data layer's containment rule."""

import json

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
    with pytest.raises(ValueError, match=r"record d1, turn 0: \[path_outside_root\]"):
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
    with pytest.raises(ValueError, match=r"item v1_0: \[path_outside_root\]"):
        load_mmvet(str(mmvet), image_root=str(tmp_path / "images"))
    mdi = tmp_path / "mdi.json"
    mdi.write_text(json.dumps([{"question number": 1, "key": "level1-sport-old", "question": "q",
                                "option": "A. x; B. y", "answer": "A", "image_path": "../secret"}]))
    with pytest.raises(ValueError, match=r"item 1: \[path_outside_root\]"):
        load_mdi(str(mdi), image_root=str(tmp_path / "images"))
    mdi.write_text(mdi.read_text().replace("../secret", "sub/../inside"))
    assert load_mdi(str(mdi), image_root=str(tmp_path / "images"))[0].image == str(tmp_path / "images" / "inside.png")
