"""One image path rule: joined to the root, kept inside it, absolute paths only when allowed."""

import os

import pytest
from PIL import Image as PILImage

from mmtune.data.config import SourceConfig
from mmtune.data.paths import ImagePathError, ImagePathRules
from mmtune.data.readers import load_source
from mmtune.data.validation import DataValidationError


@pytest.fixture
def tree(tmp_path):
    """root/pics/a.png, root/mmdu_pics/x.png, outside/secret.png, root/link -> outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "pics").mkdir(parents=True)
    (root / "mmdu_pics").mkdir()
    outside.mkdir()
    for path in (root / "pics" / "a.png", root / "mmdu_pics" / "x.png", outside / "secret.png"):
        PILImage.new("RGB", (4, 4), (9, 9, 9)).save(path)
    os.symlink(outside, root / "link")
    return root, outside


def test_relative_and_rooted_paths_join_the_root(tree):
    root, _ = tree
    rules = ImagePathRules(str(root))
    a = rules.resolve("pics/a.png")
    assert (a.path, a.problem) == (str(root / "pics" / "a.png"), None) and "relative path" in a.how
    x = rules.resolve("/mmdu_pics/x.png")
    assert (x.path, x.problem) == (str(root / "mmdu_pics" / "x.png"), None) and "rooted path" in x.how
    assert rules.resolve("pics/../pics/a.png").path == str(root / "pics" / "a.png")  # '..' that stays inside
    assert rules.resolve(str(root / "pics" / "a.png")).problem is None  # absolute, already inside


@pytest.mark.parametrize("raw", ["../outside/secret.png", "pics/../../outside/secret.png", "/../outside/secret.png"])
def test_dot_dot_escapes_are_rejected_even_when_absolute_paths_are_allowed(tree, raw):
    root, _ = tree
    resolved = ImagePathRules(str(root), allow_absolute=True).resolve(raw)
    assert resolved.problem == "path_outside_root"
    assert "climbs out of the image root" in resolved.detail
    with pytest.raises(ImagePathError):
        resolved.checked()


def test_symlink_leading_out_of_the_root_needs_explicit_permission(tree):
    root, outside = tree
    refused = ImagePathRules(str(root)).resolve("link/secret.png")
    assert refused.problem == "path_outside_root"
    assert f"symlink to {outside / 'secret.png'}" in refused.detail and "allow_absolute_image_paths" in refused.detail
    assert ImagePathRules(str(root), allow_absolute=True).resolve("link/secret.png").problem is None


def test_plain_absolute_path_needs_explicit_permission(tree):
    root, outside = tree
    secret = str(outside / "secret.png")
    refused = ImagePathRules(str(root)).resolve(secret)
    assert refused.problem == "path_outside_root" and "allow_absolute_image_paths" in refused.detail
    allowed = ImagePathRules(str(root), allow_absolute=True).resolve(secret)
    assert (allowed.path, allowed.problem) == (secret, None) and "used as is" in allowed.how
    # messages format: absolute paths are never joined to the root
    assert ImagePathRules(str(root), join_rooted=False).resolve("/mmdu_pics/x.png").problem == "path_outside_root"
    assert ImagePathRules(str(root), join_rooted=False).resolve(f"file://{root}/pics/a.png").problem is None


@pytest.mark.parametrize("raw", ["pics/a\x00.png", "\x00", "/mmdu_pics/x.png\x00", "file:///tmp/a\x00b"])
@pytest.mark.parametrize("allow_absolute", [False, True])
def test_a_nul_byte_names_no_file_whatever_the_rule(tree, raw, allow_absolute):
    root, _ = tree
    for join_rooted in (True, False):
        resolved = ImagePathRules(str(root), allow_absolute=allow_absolute, join_rooted=join_rooted,
                                  strip_prefix="/mmdu_pics/").resolve(raw)
        assert resolved.problem == "invalid_image_path"
        assert repr(raw) in resolved.detail and "NUL" in resolved.detail
        with pytest.raises(ImagePathError, match="NUL"):
            resolved.checked()


def _mmdu(path, images):
    import json

    record = {"id": "r1", "image": images, "conversations": [
        {"from": "user", "value": " ".join(["<ImageHere>"] * len(images)) + " ?"},
        {"from": "assistant", "value": "ok"}]}
    path.write_text(json.dumps([record]))
    return path


def test_training_reader_applies_the_rule_and_the_config_key(tree, tmp_path):
    root, outside = tree
    data = _mmdu(tmp_path / "d.json", ["pics/a.png", str(outside / "secret.png")])
    cfg = SourceConfig(name="s", format="mmdu", path=str(data), image_root=str(root))
    skipped = load_source(cfg, cache_dir=str(tmp_path / "c1"))
    assert skipped.report.skipped == {"path_outside_root": 1} and len(skipped.dialogues) == 0
    assert "allow_absolute_image_paths" in skipped.report.render()
    with pytest.raises(DataValidationError, match=r"record 'r1' \(#0\), turn 1 \(question\): \[path_outside_root\]"):
        load_source(cfg, mode="strict", cache_dir=str(tmp_path / "c2"))
    allowed = load_source(cfg, cache_dir=str(tmp_path / "c3"), allow_absolute_image_paths=True)
    assert [i.path for i in allowed.dialogues[0].images] == [str(root / "pics" / "a.png"), str(outside / "secret.png")]


def test_missing_image_report_shows_the_path_tried_and_how(tree, tmp_path):
    root, _ = tree
    data = _mmdu(tmp_path / "d.json", ["/mmdu_pics/nope.png"])
    src = load_source(SourceConfig(name="s", format="mmdu", path=str(data), image_root=str(root)),
                      cache_dir=str(tmp_path / "c"))
    example = src.report.examples["missing_image"][0]
    assert f"tried {root / 'mmdu_pics' / 'nope.png'}" in example
    assert f"image_root {root} + rooted path '/mmdu_pics/nope.png'" in example


def test_a_path_found_inside_the_root_carries_the_root_it_must_be_opened_in(tree, tmp_path):
    from mmtune.evaluation.benchmarks.common import load_mmdu_dialogues

    root, outside = tree
    real = os.path.realpath(root)
    assert ImagePathRules(str(root)).resolve("pics/a.png").root == real
    assert ImagePathRules(str(root)).resolve(str(root / "pics" / "a.png")).root == real
    # accepted outside the root (absolute paths allowed): not confined
    assert ImagePathRules(str(root), allow_absolute=True).resolve(str(outside / "secret.png")).root is None
    data = _mmdu(tmp_path / "d.json", ["pics/a.png"])
    (dialogue,) = load_mmdu_dialogues(data, image_root=str(root), source="s")
    assert [(i.path, i.root) for i in dialogue.images] == [(str(root / "pics" / "a.png"), real)]
