import json
import re

import numpy as np
import pytest
from PIL import Image as PILImage

from mmtune.data.config import SourceConfig
from mmtune.data.readers import load_source
from mmtune.data.synthetic import COLORS, SHAPES, generate_synthetic, is_correct, normalize_answer


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn")
    return generate_synthetic(out, n_train=60, n_test=10, n_llava=40, seed=0, image_size=32)


def _answer_from_pixels(path):
    """Colour and shape read back from the image alone (what a model has to learn)."""
    a = np.asarray(PILImage.open(path).convert("RGB")).astype(int)
    colour = min(COLORS, key=lambda c: np.abs(a[16, 16] - np.array(COLORS[c])).sum())
    mask = np.abs(a - np.array(COLORS[colour])).sum(-1) < 90
    fill = mask.mean()
    shape = "square" if fill > 0.32 else "circle" if fill > 0.22 else "triangle"
    return colour, shape


def test_splits_are_written_in_their_formats(syn):
    p = syn
    train, test, llava = (json.load(open(f)) for f in (p.train_json, p.test_json, p.llava_json))
    assert (len(train), len(test), len(llava)) == (60, 10, 40)
    assert all(path.startswith("/mmdu_pics/") for r in test for path in r["image"])
    assert {t["from"] for r in train for t in r["conversations"]} == {"user", "assistant"}
    assert {t["from"] for r in llava for t in r["conversations"]} == {"human", "gpt"}
    starts = sum(r["conversations"][0]["value"].startswith("<image>\n") for r in llava if "image" in r)
    ends = sum(r["conversations"][0]["value"].endswith("\n<image>") for r in llava if "image" in r)
    assert starts and ends and starts + ends == sum("image" in r for r in llava) < 40  # some text-only
    later = [r for r in train if any("<ImageHere>" in t["value"] for t in r["conversations"][2::2])]
    assert later, "some dialogues introduce images in later turns"
    assert any(len(r["image"]) >= 3 for r in train)


def test_every_split_loads_without_problems(syn, tmp_path):
    p = syn
    for name, fmt, path in (("t", "mmdu", p.train_json), ("e", "mmdu", p.test_json), ("l", "llava", p.llava_json)):
        src = load_source(SourceConfig(name=name, format=fmt, path=path, image_root=p.image_dir),
                          mode="strict", cache_dir=str(tmp_path))
        assert src.report.ok and src.report.records_kept == len(json.load(open(path)))


def test_answers_are_determined_by_the_pixels(syn, tmp_path):
    p = syn
    src = load_source(SourceConfig(name="t", format="mmdu", path=p.train_json, image_root=p.image_dir), cache_dir=str(tmp_path))
    kinds = set()
    for d in src.dialogues:
        seen = [_answer_from_pixels(i.path) for i in d.images]
        for u, a in d.exchanges():
            q, ans = d.turns[u].text, d.turns[a].text
            assert len(ans.split()) == 1
            if m := re.search(r"What color is the shape in Image(\d+)\?", q):
                assert ans == seen[int(m[1]) - 1][0]; kinds.add("color")
            elif m := re.search(r"What shape is in Image(\d+)\?", q):
                assert ans == seen[int(m[1]) - 1][1]; kinds.add("shape")
            elif m := re.search(r"Do Image(\d+) and Image(\d+) have the same (color|shape)\?", q):
                k = 0 if m[3] == "color" else 1
                same = seen[int(m[1]) - 1][k] == seen[int(m[2]) - 1][k]
                assert ans == ("yes" if same else "no"); kinds.add(m[3])
            else:
                raise AssertionError(f"unexpected question {q!r}")
            # Questions only name images already shown.
            shown = sum(len(t.images) for t in d.turns[: u + 1])
            assert all(int(n) <= shown for n in re.findall(r"Image(\d+)", q))
    assert kinds == {"color", "shape"}


def test_vocabulary_is_small_and_yes_no_balanced(syn):
    p = syn
    answers = [t["value"] for r in json.load(open(p.train_json)) for t in r["conversations"] if t["from"] == "assistant"]
    assert set(answers) <= set(COLORS) | set(SHAPES) | {"yes", "no"}
    yes, no = answers.count("yes"), answers.count("no")
    assert yes and no and 0.25 < yes / (yes + no) < 0.75


def test_deterministic_and_held_out(tmp_path):
    a = generate_synthetic(tmp_path / "a", n_train=5, n_test=5, n_llava=5, seed=1)
    b = generate_synthetic(tmp_path / "b", n_train=5, n_test=5, n_llava=5, seed=1)
    c = generate_synthetic(tmp_path / "c", n_train=5, n_test=9, n_llava=5, seed=1)
    for f in ("train_json", "test_json", "llava_json"):
        assert open(getattr(a, f)).read() == open(getattr(b, f)).read()
    assert open(a.train_json).read() == open(c.train_json).read()  # test size does not move train
    assert json.load(open(a.train_json))[0]["id"].startswith("syn-train")
    img = PILImage.open(f"{a.image_dir}/synthetic/syn-llava-000000.jpg")
    assert img.format == "JPEG" and img.size == (32, 32)


def test_answer_rule():
    assert normalize_answer("  Red.\n") == "red"
    assert is_correct("Yes!", "yes") and is_correct("circle", "Circle")
    assert not is_correct("red circle", "red") and not is_correct("", "no")


def test_question_kinds_limits_the_templates_and_rejects_unknown_names(tmp_path):
    p = generate_synthetic(tmp_path / "s", n_train=40, n_test=5, n_llava=0, seed=1, image_size=32,
                           question_kinds=["color", "shape", "same_color"])
    questions = [t["value"] for r in json.load(open(p.train_json)) for t in r["conversations"] if t["from"] == "user"]
    assert any("same color" in q for q in questions) and any("What shape" in q for q in questions)
    assert not any("same shape" in q for q in questions)
    with pytest.raises(ValueError, match=r"question_kinds=\['size'\].*unknown: \['size'\]"):
        generate_synthetic(tmp_path / "bad", n_train=1, n_test=1, n_llava=0, question_kinds=["size"])


def test_solid_style_asks_about_named_images_and_which_image_has_a_colour(tmp_path):
    from mmtune.data.synthetic import question_kind

    p = generate_synthetic(tmp_path / "s", n_train=60, n_test=5, n_llava=0, seed=2, image_size=32, min_images=2,
                           max_images=3, max_turns=4, question_kinds=["color", "same_color", "which_color"], style="solid")
    kinds = set()
    for record in json.load(open(p.train_json)):
        colours = []
        for path in record["image"]:
            pixels = np.asarray(PILImage.open(f"{p.image_dir}/{path}").convert("RGB")).reshape(-1, 3)
            assert (pixels == pixels[0]).all()  # one colour over the whole image
            colours.append(next(c for c, rgb in COLORS.items() if tuple(pixels[0]) == rgb))
        conv = record["conversations"]
        shown = 0
        for q, a in zip(conv[::2], conv[1::2]):
            shown += q["value"].count("<ImageHere>")
            kind = question_kind(q["value"])
            kinds.add(kind)
            if m := re.search(r"What color is Image(\d+)\?$", q["value"]):
                assert a["value"] == colours[int(m[1]) - 1]
            elif m := re.search(r"Which image is (\w+)\?$", q["value"]):
                visible = colours[:shown]
                assert visible.count(m[1]) == 1 and a["value"] == f"Image{visible.index(m[1]) + 1}"
            else:
                m = re.search(r"Do Image(\d+) and Image(\d+) have the same color\?$", q["value"])
                assert m and a["value"] == ("yes" if colours[int(m[1]) - 1] == colours[int(m[2]) - 1] else "no")
    assert kinds == {"color", "same_color", "which_color"}
    with pytest.raises(ValueError, match="no shape"):
        generate_synthetic(tmp_path / "bad", n_train=1, n_test=1, n_llava=0, style="solid", question_kinds=["shape"])


EXPECTED_SEED0_FIRST_DIALOGUE = [
    "Image1: <ImageHere>. Image2: <ImageHere>. What shape is in Image2?", "square",
    "What color is the shape in Image1?", "yellow", "What shape is in Image1?", "square",
    "What color is the shape in Image2?", "yellow", "What shape is in Image1?", "square",
]


def test_upfront_layout_without_repeats_shows_every_image_first_and_never_asks_twice(tmp_path):
    p = generate_synthetic(tmp_path / "s", n_train=80, n_test=5, n_llava=0, seed=3, image_size=16, min_images=2,
                           max_images=3, max_turns=6, question_kinds=["color", "same_color", "which_color"],
                           style="solid", layout="upfront", repeat_questions=False)
    turns = []
    for record in json.load(open(p.train_json)):
        users = [t["value"] for t in record["conversations"] if t["from"] == "user"]
        assert users[0].count("<ImageHere>") == len(record["image"]) >= 2
        assert not any("<ImageHere>" in u for u in users[1:])
        questions = [u.split(". ")[-1] for u in users]
        assert len(set(questions)) == len(questions), questions  # a new question every turn
        turns.append(len(users))
    # Two images allow at most five distinct questions of these kinds (two colours, one
    # comparison, up to two "which image is <colour>?"): more than three turns need the
    # "which image" questions or a third image.
    assert max(turns) > 3 and min(turns) >= 2
    with pytest.raises(ValueError, match=r"layout='sideways'.*staggered"):
        generate_synthetic(tmp_path / "bad", n_train=1, n_test=1, n_llava=0, layout="sideways")


def test_default_generator_output_does_not_move(tmp_path):
    # The defaults keep their exact output (seeded data of earlier runs and tests stay valid).
    p = generate_synthetic(tmp_path / "s", n_train=3, n_test=0, n_llava=0, seed=0, image_size=8)
    first = json.load(open(p.train_json))[0]["conversations"]
    assert [t["value"] for t in first] == EXPECTED_SEED0_FIRST_DIALOGUE


def test_chance_level_is_the_mean_of_one_over_each_questions_answers(tmp_path):
    from mmtune.data.synthetic import chance_exact_match

    records = [{"id": "a", "image": ["1.png", "2.png"], "conversations": [
        {"from": "user", "value": "Image1: <ImageHere>. Image2: <ImageHere>. What color is Image2?"},
        {"from": "assistant", "value": "red"},
        {"from": "user", "value": "Do Image1 and Image2 have the same color?"}, {"from": "assistant", "value": "no"},
        {"from": "user", "value": "Which image is red?"}, {"from": "assistant", "value": "Image2"},
        {"from": "user", "value": "What shape is in Image1?"}, {"from": "assistant", "value": "circle"}]}]
    path = tmp_path / "test.json"
    path.write_text(json.dumps(records))
    assert chance_exact_match(path) == pytest.approx(100 * (1 / 4 + 1 / 2 + 1 / 2 + 1 / 3) / 4)
