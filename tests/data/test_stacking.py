import re

import numpy as np
import pytest

from mmtune.data.config import DataConfig, MixtureConfig, SourceConfig, StackingConfig
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.mixture import build_mixture
from mmtune.data.stacking import plan_stacks, renumber_image_refs, stack_dialogues


def test_renumber_reference_forms():
    text = "Image1 vs Image 2, image3 and <image-1>, <image 2>; Image12 and Image0 and MyImage1 stay."
    assert renumber_image_refs(text, 3, num_images=3) == (
        "Image4 vs Image 5, image6 and <image-4>, <image 5>; Image12 and Image0 and MyImage1 stay."
    )
    assert renumber_image_refs(text, 0, 3) == text


def _mmdu_dialogue(i, n_images):
    intro = "".join(f"Image{k}: " for k in range(1, n_images + 1))
    segments = []
    for k in range(1, n_images + 1):
        segments += [f"Image{k}: ", Image(f"/p/{i}-{k}.png"), ". "]
    segments.append(f"Compare Image1 and Image{n_images}.")
    assert intro
    return Dialogue(
        f"d{i}", "mmdu",
        (Turn("user", tuple(segments)), Turn("assistant", (f"Image1 of d{i} differs from Image{n_images}.",)),
         Turn("user", ("And Image 1?",)), Turn("assistant", ("Same.",))),
    )


def _assert_labels_attached(d):
    """Every image is introduced as "ImageK: " where K is its position in the dialogue."""
    k = 0
    for turn in d.turns:
        for prev, seg in zip((None,) + turn.segments, turn.segments):
            if isinstance(seg, Image):
                k += 1
                assert prev.endswith(f"Image{k}: "), (prev, k)


def test_stack_keeps_each_reference_on_its_own_image():
    parts = [_mmdu_dialogue(0, 2), _mmdu_dialogue(1, 3), _mmdu_dialogue(2, 1)]
    s = stack_dialogues(parts)
    assert s.id == "d0+d1+d2" and s.meta["stacked_from"] == ["d0", "d1", "d2"]
    assert [i.path for i in s.images] == ["/p/0-1.png", "/p/0-2.png", "/p/1-1.png", "/p/1-2.png", "/p/1-3.png", "/p/2-1.png"]
    assert len(s.turns) == 12 and list(s.exchanges())[-1] == (10, 11)
    _assert_labels_attached(s)
    assert s.turns[4].segments[-1] == "Compare Image3 and Image5."
    assert s.turns[5].text == "Image3 of d1 differs from Image5."
    assert s.turns[6].text == "And Image 3?"
    assert s.turns[8].segments[-1] == "Compare Image6 and Image6."


def test_system_turns():
    sys_turn = Turn("system", ("Be brief.",))
    a = Dialogue("a", "s", (sys_turn,) + _mmdu_dialogue(0, 1).turns)
    b = Dialogue("b", "s", (sys_turn,) + _mmdu_dialogue(1, 1).turns)
    s = stack_dialogues([a, b])
    assert [t.role for t in s.turns].count("system") == 1 and s.turns[0] == sys_turn
    c = Dialogue("c", "s", (Turn("system", ("Other.",)),) + _mmdu_dialogue(2, 1).turns)
    with pytest.raises(ValueError, match="system turns differ"):
        stack_dialogues([a, c])


def test_plan_respects_budgets_and_uses_every_dialogue_once():
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 5, 200)
    toks = rng.integers(100, 3000, 200)
    toks[17] = 50_000  # over budget on its own: stays alone, not dropped
    groups = plan_stacks(imgs, toks, max_images=10, max_tokens=8000, seed=1)
    assert sorted(i for g in groups for i in g) == list(range(200))
    for g in groups:
        if len(g) > 1:
            assert imgs[g].sum() <= 10 and toks[g].sum() <= 8000
    assert [17] in groups
    assert plan_stacks(imgs, toks, max_images=10, max_tokens=8000, seed=1) == groups
    assert np.mean([len(g) for g in groups]) > 2


def test_stacking_in_a_mixture_of_synthetic_dialogues(tmp_path):
    from mmtune.data.synthetic import generate_synthetic

    p = generate_synthetic(tmp_path / "syn", n_train=40, n_test=1, n_llava=5)
    source = SourceConfig(name="mmdu", format="mmdu", path=p.train_json, image_root=p.image_dir)
    base = DataConfig(mixture=MixtureConfig(sources=[source], tokens_per_image=16), cache_dir=str(tmp_path / "c"))
    plain = build_mixture(base)
    base.stacking = StackingConfig(enabled=True, max_images=8, max_tokens=100_000)
    stacked = build_mixture(base)
    src = stacked.sources[0]
    assert len(src.dialogues) < 40 and sum(len(g) for g in src.groups) == 40
    assert int(src.num_images.sum()) == plain.reports[0].images
    for i in range(len(src.dialogues)):
        d = src.dialogues[i]
        assert d.num_images == src.num_images[i] <= 8
        _assert_labels_attached(d)
        # Every question names an image that exists in the stacked dialogue.
        for turn in d.turns:
            for n in re.findall(r"Image(\d+)", turn.text):
                assert 1 <= int(n) <= d.num_images
    assert stacked.counts == [len(src.dialogues)]
    assert len(list(stacked.sampler())) == len(src.dialogues)
