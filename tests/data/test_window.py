"""The window report: every dialogue measured as training measures it, against a GPU's share
of the row and against the whole row, the long ones named with what collator.truncation does."""

import json

import pytest
from PIL import Image as PILImage

from mmtune.data.config import DataConfig, MixtureConfig, SourceConfig
from mmtune.data.encoding import encode_example
from mmtune.data.mixture import build_mixture
from mmtune.data.window import window_report

# (record id, words per turn, exchanges, with an image): lengths rising with the words
_DIALOGUES = [("d0", 5, 1, False), ("d1", 40, 1, True), ("d2", 120, 1, False), ("d3", 100, 2, True),
              ("d4", 600, 1, False)]


def _records():
    records = []
    for rid, words, exchanges, image in _DIALOGUES:
        conv = []
        for t in range(exchanges):
            mark = "<ImageHere> " if image and t == 0 else ""
            conv += [{"from": "user", "value": f"{mark}question {t} " + "word " * words},
                     {"from": "assistant", "value": f"answer {t} " + "word " * words}]
        records.append({"id": rid, "image": ["red.jpg"] if image else [], "conversations": conv})
    return records


@pytest.fixture
def mixture(tmp_path):
    PILImage.new("RGB", (32, 32), "red").save(tmp_path / "red.jpg")
    (tmp_path / "chat.json").write_text(json.dumps(_records()))
    source = SourceConfig(name="chat", format="mmdu", path=str(tmp_path / "chat.json"), image_root=str(tmp_path))
    return build_mixture(DataConfig(mixture=MixtureConfig(sources=[source]), cache_dir=str(tmp_path / "cache")))


def _lengths(adapter, mixture, max_length=None, truncation="drop_trailing_turns"):
    """Each dialogue's tokens as the training dataset encodes it (0: skipped)."""
    out = []
    for d in mixture.sources[0].dialogues:
        example = encode_example(adapter, d, max_length=max_length, truncation=truncation)
        out.append(0 if example is None else len(example.input_ids))
    return out


def test_counts_dialogues_over_a_gpus_share_and_over_the_row(adapter, mixture):
    full = _lengths(adapter, mixture)
    assert full == sorted(full) and full[1] > full[0] + 16  # d1's image is 16 tokens
    row = full[2]  # d2 fits exactly, d3 and d4 do not
    kept = _lengths(adapter, mixture, max_length=row)
    assert 0 < kept[3] < full[3] and kept[4] == 0  # d3 keeps its first exchange, d4 has none that fits
    report = window_report(adapter, mixture, max_length=row, truncation="drop_trailing_turns", sequence_parallel=2)
    share = -(-row // 2)
    assert report.per_gpu == share and report.samples == 5
    assert report.over_gpu == sum(n > share for n in full) == 3
    assert [e.dialogue_id for e in report.over_gpu_examples] == ["d2", "d3", "d4"]
    assert [(d.dialogue_id, d.length, d.kept) for d in report.over_row] == [("d3", full[3], kept[3]), ("d4", full[4], 0)]
    assert report.longest.dialogue_id == "d4" and report.longest.length == full[4]
    assert report.skipped == 1
    text = report.render()
    path = mixture.sources[0].config.path
    assert f"collator.max_length={row} tokens per row, training.sequence_parallel.size=2 ({share} tokens" in text
    assert f"without sequence parallelism ({share}-token rows, a GPU's share): 3 of 5 dialogue(s) longer" in text
    assert f"with sequence parallelism over 2 GPUs ({row}-token rows): 2 of 5 dialogue(s) longer" in text
    assert f"{path} record 'd3' ({full[3]} tokens): truncated to {kept[3]} tokens" in text
    assert f"{path} record 'd4' ({full[4]} tokens): skipped (collator.truncation=drop_trailing_turns, its first" in text
    need = 1
    while need * share < full[4]:  # the smallest power of two whose rows hold d4
        need *= 2
    assert f"training.sequence_parallel.size={need} with collator.max_length={need * share}" in text


def test_the_action_follows_collator_truncation_and_one_gpu_has_one_window(adapter, mixture):
    full = _lengths(adapter, mixture)
    row = full[2]
    skip = window_report(adapter, mixture, max_length=row, truncation="skip_sample", sequence_parallel=1)
    assert skip.per_gpu == row and [d.kept for d in skip.over_row] == [0, 0] and skip.skipped == 2
    text = skip.render()
    assert "without sequence parallelism" not in text and f"{row}-token rows: 2 of 5 dialogue(s) longer" in text
    assert text.count("skipped (collator.truncation=skip_sample)") == 2
    # error: training refuses; the report names every one instead of stopping at the first
    refuse = window_report(adapter, mixture, max_length=row, truncation="error", sequence_parallel=4)
    assert [d.dialogue_id for d in refuse.over_row] == ["d3", "d4"] and refuse.skipped == 2
    assert refuse.render().count("refused: training stops at start-up naming it (collator.truncation=error)") == 2
    # a row every dialogue fits: none over it, the GPU's share still counted
    roomy = window_report(adapter, mixture, max_length=full[4], truncation="skip_sample", sequence_parallel=4)
    assert not roomy.over_row and roomy.over_gpu == sum(n > -(-full[4] // 4) for n in full) and roomy.skipped == 0
