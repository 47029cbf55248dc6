"""Encoding: exact labels, and truncation that never cuts an image (20 images, 2k/4k/8k)."""

import pytest

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import encode_example, encode_examples
from mmtune.data.truncation import SampleTooLongError, TruncationStats
from mmtune.models.base import IGNORE_INDEX


def twenty_image_dialogue(first_images=2):
    """10 exchanges introducing 20 images in all (0-4 per user turn), varied text."""
    per_turn = [first_images, 3, 0, 4, 1, 2, 0, 3, 2, 3]
    per_turn[-1] = 20 - sum(per_turn[:-1])
    turns, k = [], 0
    for t, n in enumerate(per_turn):
        segments = []
        for _ in range(n):
            k += 1
            segments += [f"Image{k}: ", Image(f"/missing/pic{k}.jpg"), ". "]
        segments.append("Compare the images. What colour is the shape? " * (1 + t % 3))
        turns.append(Turn("user", tuple(segments)))
        turns.append(Turn("assistant", (f"Answer {t}: the shape is a red square. " * (2 + t % 4),)))
    return Dialogue("twenty", "mmdu", tuple(turns))


def image_runs(ids, image_token_id):
    runs, current = [], 0
    for token in ids:
        if token == image_token_id:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs


@pytest.mark.parametrize("budget", [2048, 4096, 8192])
def test_twenty_images_stay_one_to_one_with_their_tokens(adapter_576, budget):
    dialogue = twenty_image_dialogue()
    assert dialogue.num_images == 20
    full = encode_example(adapter_576, dialogue, max_length=None)
    assert len(full) > 8192  # every budget truncates
    stats = TruncationStats()
    example = encode_example(adapter_576, dialogue, max_length=budget, stats=stats)
    assert example is not None and len(example) <= budget
    runs = image_runs(example.input_ids, adapter_576.image_token_id)
    # one run of exactly 576 tokens per kept image, in dialogue order
    assert runs == [576] * len(example.images)
    assert [r.path for r in example.images] == [im.path for im in dialogue.images[: len(example.images)]]
    # whole exchanges only: the kept sequence is a prefix of the full one, cut at a turn end
    n = len(example)
    assert example.input_ids == full.input_ids[:n] and example.labels == full.labels[:n]
    assert example.input_ids[-1] == adapter_576.tokenizer.eos_token_id
    kept_turns = len(dialogue.turns) - example.dropped_turns
    assert kept_turns % 2 == 0 and kept_turns >= 2
    assert len(example.images) == sum(len(t.images) for t in dialogue.turns[:kept_turns])
    # the next exchange would not have fitted
    longer = encode_example(adapter_576, Dialogue("x", "t", dialogue.turns[: kept_turns + 2]), max_length=None)
    assert len(longer) > budget
    assert stats.truncated == 1 and stats.dropped_images == 20 - len(example.images)
    # image tokens never carry labels
    assert all(l == IGNORE_INDEX for t, l in zip(example.input_ids, example.labels) if t == adapter_576.image_token_id)


def test_first_exchange_too_long_is_skipped_and_counted(adapter_576):
    dialogue = twenty_image_dialogue(first_images=4)  # 4 x 576 = 2304 > 2048
    stats = TruncationStats()
    assert encode_example(adapter_576, dialogue, max_length=2048, stats=stats) is None
    assert stats.skipped == 1 and stats.skipped_ids == ["twenty"]


def test_strategies(adapter_576):
    dialogue = twenty_image_dialogue()
    stats = TruncationStats()
    assert encode_example(adapter_576, dialogue, max_length=4096, truncation="skip_sample", stats=stats) is None
    assert stats.skipped == 1
    with pytest.raises(SampleTooLongError, match="'twenty'.*max_length=4096"):
        encode_example(adapter_576, dialogue, max_length=4096, truncation="error")
    with pytest.raises(ValueError, match="truncation='cut'"):
        encode_example(adapter_576, dialogue, max_length=4096, truncation="cut")
    fits = encode_example(adapter_576, dialogue, max_length=20000, truncation="error")
    assert fits.dropped_turns == 0 and len(fits.images) == 20


def test_last_assistant_labels_the_last_kept_turn(adapter_576):
    dialogue = twenty_image_dialogue()
    example = encode_example(adapter_576, dialogue, max_length=4096, train_on="last_assistant")
    kept = (len(dialogue.turns) - example.dropped_turns) // 2
    labelled = [t for t, l in zip(example.input_ids, example.labels) if l != IGNORE_INDEX]
    text = adapter_576.tokenizer.decode(labelled)
    assert text == " " + dialogue.turns[2 * kept - 1].text + "</s>"


def test_batched_encoding_equals_single(adapter_576):
    dialogues = [twenty_image_dialogue(), Dialogue("s", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Yes",))))]
    single = [encode_example(adapter_576, d, max_length=4096) for d in dialogues]
    batched = encode_examples(adapter_576, dialogues, max_length=4096)
    assert [(e.input_ids, e.labels, e.images) for e in single] == [(e.input_ids, e.labels, e.images) for e in batched]


def test_image_refs_name_their_turn(adapter_576):
    dialogue = Dialogue(
        "r", "t",
        (Turn("system", ("sys",)), Turn("user", (Image("/a.jpg"), "q")), Turn("assistant", ("a",)),
         Turn("user", ("q2", Image("/b.jpg"))), Turn("assistant", ("b",))),
    )
    example = encode_example(adapter_576, dialogue, max_length=None)
    assert [(r.path, r.turn) for r in example.images] == [("/a.jpg", 1), ("/b.jpg", 3)]
