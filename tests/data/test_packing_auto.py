"""Packing for the ``auto`` family's tested classes (every class of ``mmtune.testing.checkpoints.KINDS``
on tiny random-weight checkpoints built from transformers' classes; the gaps of ``GAPS``): a
packed row's loss, gradients and logits equal every sample run alone at 1e-5, with per-sample
attention, or transformers' block mask where the model has sliding-window layers (Gemma 3, whose
images attend bidirectionally: its sliding mask is the full one within the window, see
``mmtune.models.auto``); truncation keeps whole exchanges."""

from dataclasses import replace

import re

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.collator import CollatorConfig, MultiImageDataset, model_inputs
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import Example, encode_example
from mmtune.models.base import IGNORE_INDEX
from mmtune.testing.checkpoints import KINDS
from mmtune.training.loss import materialized_cross_entropy_sum
from mmtune.training.packed_attention import PACKED_IMPLEMENTATIONS, language_model, model_support_problem, use_attention
from tests.support.auto_checkpoints import adapter, cases


@pytest.fixture(scope="module")
def image_paths(tmp_path_factory):
    """Images of different sizes and aspect ratios (tiling processors make 1 to 4 tiles of them)."""
    root = tmp_path_factory.mktemp("packing_auto")
    paths = []
    for k, size in enumerate([(80, 60), (40, 120), (30, 30), (120, 56)]):
        path = root / f"{k}.png"
        PILImage.effect_noise(size, 60).convert("RGB").save(path)
        paths.append(str(path))
    return paths


def _dialogues(paths):
    return [
        Dialogue("a", "t", (Turn("user", (Image(paths[0]), "What is it?")), Turn("assistant", ("red",)))),
        Dialogue("b", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Hello there. Yes",)),
                            Turn("user", ("Both: ", Image(paths[1]), Image(paths[2]))),
                            Turn("assistant", ("green and blue",)))),
        Dialogue("c", "t", (Turn("user", ("Only text here",)), Turn("assistant", ("ok",)))),
        Dialogue("d", "t", (Turn("user", ("Only text here",)), Turn("assistant", ("no",)))),
        Dialogue("e", "t", (Turn("user", ("Wide: ", Image(paths[3]), " describe.")), Turn("assistant", ("dark",)))),
    ]


# Row 0: a, the one-token sample, c, e; row 1: b, d and the row padding (a sample of its own).
ORDER = ["a", "one", "c", "e", "b", "d"]
ROWS = [0, 0, 0, 0, 1, 1]


def _loss_and_grads(model, batches):
    """Token-mean next-token loss over ``batches``, its gradients and each batch's logits."""
    model.zero_grad(set_to_none=True)
    tokens = sum(int(b["num_loss_tokens"]) for b in batches)
    total, logits = 0.0, []
    for batch in batches:
        out = model(**model_inputs(batch))
        loss = materialized_cross_entropy_sum(out.logits, batch["labels"]) / tokens
        loss.backward()
        total += float(loss.detach())
        logits.append(out.logits.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads, logits


@pytest.mark.parametrize("kind", cases("packing"))
def test_packed_rows_equal_each_sample_alone(kind, image_paths):
    auto = adapter(kind)
    model = auto.load_model(attn_implementation="sdpa").train()
    dataset = MultiImageDataset(_dialogues(image_paths), auto, CollatorConfig(max_length=2048, batching="packing"))
    collate = dataset.collator()
    by_id = {e.dialogue_id: e for e in (dataset[i] for i in range(len(dataset)))}
    by_id["one"] = Example("one", [by_id["c"].input_ids[0]], [IGNORE_INDEX])
    examples = [by_id[k] for k in ORDER]
    packed = collate([replace(e, row=r) for e, r in zip(examples, ROWS)])
    assert packed["attention_mask"] is None
    text_config = auto.text_config(model.config)
    from mmtune.models.masks import PackedStateLayersError, unpackable_layer_types

    kinds = unpackable_layer_types(text_config)
    if kinds:
        # recurrent layers would carry one sample's state into the next: refused, not inexact
        with pytest.raises(PackedStateLayersError, match=re.escape(f"has layers of kinds {kinds}")):
            _loss_and_grads(model, [packed])
        return
    lm = language_model(model, text_config)

    alone = _loss_and_grads(model, [collate([e]) for e in examples])
    paths = {"block mask": _loss_and_grads(model, [packed])}  # transformers' own, from the restarting positions
    problem = model_support_problem(model, text_config)
    if problem:  # windowed layers: the per-sample kernels refuse them, training keeps the block mask
        assert "sliding_window" in problem
    else:
        with use_attention(lm, PACKED_IMPLEMENTATIONS["sdpa"]):
            paths["per-sample attention"] = _loss_and_grads(model, [packed])
    for what, result in paths.items():
        assert abs(result[0] - alone[0]) <= 1e-5, what
        assert result[1].keys() == alone[1].keys(), what
        assert any(part in n for n in result[1] for part in ("vision", "vit", "visual")), "the vision tower learns"
        for name in result[1]:
            torch.testing.assert_close(result[1][name], alone[1][name], rtol=1e-5, atol=1e-5, msg=f"{kind}, {what}: {name}")
        starts = {0: 0, 1: 0}
        for example, row, logits in zip(examples, ROWS, alone[2]):
            n = len(example)
            torch.testing.assert_close(result[2][0][row, starts[row]:starts[row] + n], logits[0], rtol=0, atol=1e-5,
                                       msg=f"{kind}, {what}: logits of {example.dialogue_id}")
            starts[row] += n


@pytest.mark.parametrize("kind", cases("truncation"))
def test_truncation_keeps_whole_exchanges(kind, image_paths):
    """A dialogue over the length limit loses its last exchanges whole: the example is exactly
    the encoding of the dialogue cut after an exchange, with that exchange's images only."""
    auto = adapter(kind)
    dialogue = _dialogues(image_paths)[1]  # text exchange, then an exchange with two images
    first = Dialogue("b", "t", dialogue.turns[:2])
    full = encode_example(auto, dialogue, max_length=None)
    short = encode_example(auto, first, max_length=None)
    cut = encode_example(auto, dialogue, max_length=len(full) - 1)
    assert cut is not None and len(short) < len(full)
    assert cut.input_ids == short.input_ids and cut.labels == short.labels and cut.images == []
    assert any(label != IGNORE_INDEX for label in cut.labels)


# the classes whose template is not prefix-stable (their entries carry the fidelity tests' tagged copy)
@pytest.mark.parametrize("kind", [kind for kind, spec in KINDS.items() if spec.fidelity_reference_template])
def test_a_template_that_is_not_prefix_stable_truncates_to_its_own_rendering_of_the_cut_dialogue(kind, image_paths):
    """Qwen3.5's template writes the thinking block only into answers after the last user turn, so the
    cut dialogue's last answer is rendered differently from the same answer in the whole dialogue:
    the truncated sample is the processor's encoding of the cut dialogue, not a cut of the whole."""
    auto = adapter(kind)
    assert auto.prefix_stable is False
    dialogue = _dialogues(image_paths)[1]
    first = Dialogue("b", "t", dialogue.turns[:2])
    full = encode_example(auto, dialogue, max_length=None)
    cut = encode_example(auto, dialogue, max_length=len(full) - 1)
    theirs = auto._processor_call(first)["input_ids"][0].tolist()
    assert cut is not None and cut.input_ids == theirs
    assert full.input_ids[:len(cut.input_ids)] != cut.input_ids  # the whole rendering's cut would differ
    answer = auto.tokenizer.decode([t for t, label in zip(cut.input_ids, cut.labels) if label != IGNORE_INDEX])
    assert "</think>" in answer and "Hello there. Yes" in answer
    from mmtune.data.lengths import compute_lengths

    planned = compute_lengths(auto, [dialogue], max_length=len(full) - 1)  # the packing plan's length, the same
    assert int(planned.lengths[0]) == len(cut)
