"""Packing with M-RoPE (the qwen2_vl family): a packed row's loss, gradients and logits equal every
sample run alone, with transformers' block mask and with per-sample attention, sdpa and eager; the
batch layout the adapter declares ([4, B, L] positions, concatenated image inputs); no 4-D mask on
the per-sample path; and what breaks when the positions do not restart per sample."""

from dataclasses import replace

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.collator import CollatorConfig, MultiImageDataset, batch_keys, model_inputs
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import Example
from mmtune.models.base import IGNORE_INDEX
from mmtune.models.config import ModelConfig
from mmtune.models.qwen2_vl import MODEL_TYPES
from mmtune.models.registry import build_adapter
from mmtune.training.loss import materialized_cross_entropy_sum
from mmtune.training.packed_attention import PACKED_IMPLEMENTATIONS, language_model, use_attention


@pytest.fixture(scope="module")
def image_paths(tmp_path_factory):
    """Images of different sizes and aspect ratios: 4 to 30 image tokens, h != w grids."""
    root = tmp_path_factory.mktemp("mrope")
    paths = []
    for k, size in enumerate([(80, 60), (40, 120), (30, 30), (200, 56)]):
        path = root / f"{k}.png"
        PILImage.effect_noise(size, 60).convert("RGB").save(path)
        paths.append(str(path))
    return paths


def _dialogues(paths):
    return [
        # an image first: its M-RoPE rows start at 0 like the text row, then fall behind it
        Dialogue("a", "t", (Turn("user", (Image(paths[0]), "What is it?")), Turn("assistant", ("red",)))),
        Dialogue("b", "t", (Turn("user", ("Hi",)), Turn("assistant", ("Hello there. Yes",)),
                            Turn("user", ("Both: ", Image(paths[1]), Image(paths[2]))),
                            Turn("assistant", ("green and blue",)))),
        Dialogue("c", "t", (Turn("user", ("Only text here",)), Turn("assistant", ("ok",)))),
        Dialogue("d", "t", (Turn("user", ("Only text here",)), Turn("assistant", ("no",)))),
        Dialogue("e", "t", (Turn("user", ("Wide: ", Image(paths[3]), " describe.")), Turn("assistant", ("dark",)))),
    ]


_ADAPTERS: dict = {}


def _adapter(model_type):
    if model_type not in _ADAPTERS:
        _ADAPTERS[model_type] = build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": model_type}))
    return _ADAPTERS[model_type]


def _dataset(adapter, paths):
    return MultiImageDataset(_dialogues(paths), adapter, CollatorConfig(max_length=512, batching="packing"))


# Row 0: a, the one-token sample, c, e; row 1: b, d and the row padding (a sample of its own).
ORDER = ["a", "one", "c", "e", "b", "d"]
ROWS = [0, 0, 0, 0, 1, 1]


def _examples(dataset):
    by_id = {e.dialogue_id: e for e in (dataset[i] for i in range(len(dataset)))}
    by_id["one"] = Example("one", [by_id["c"].input_ids[0]], [IGNORE_INDEX])
    return [by_id[k] for k in ORDER]


def _packed(collate, examples):
    batch = collate([replace(e, row=r) for e, r in zip(examples, ROWS)])
    lengths = [sum(len(e) for e, r in zip(examples, ROWS) if r == k) for k in (0, 1)]
    assert lengths[0] != lengths[1], "one row should carry padding"
    return batch


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


def _assert_same(a, b, what):
    (loss_a, grads_a, _), (loss_b, grads_b, _) = a, b
    assert abs(loss_a - loss_b) <= 1e-5, what
    assert grads_a.keys() == grads_b.keys() and any("visual" in n for n in grads_a), what
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=1e-5, msg=f"{what}: {name}")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_rows_equal_each_sample_alone(model_type, attn, image_paths):
    adapter = _adapter(model_type)
    model = adapter.load_model(attn_implementation=attn).train()
    dataset = _dataset(adapter, image_paths)
    collate = dataset.collator()
    examples = _examples(dataset)
    packed = _packed(collate, examples)
    assert packed["attention_mask"] is None and packed["position_ids"].shape[:2] == (4, 2)
    lm = language_model(model, adapter.text_config(model.config))

    block = _loss_and_grads(model, [packed])
    with use_attention(lm, PACKED_IMPLEMENTATIONS[attn]):
        per_sample = _loss_and_grads(model, [packed])
    alone = _loss_and_grads(model, [collate([e]) for e in examples])

    _assert_same(block, alone, "block mask vs each sample alone")
    _assert_same(per_sample, alone, "per-sample attention vs each sample alone")
    starts = {0: 0, 1: 0}
    for example, row, logits in zip(examples, ROWS, alone[2]):
        n = len(example)
        for path in (block, per_sample):
            torch.testing.assert_close(path[2][0][row, starts[row]:starts[row] + n], logits[0], rtol=0, atol=1e-5)
        starts[row] += n


def test_the_batch_is_laid_out_as_the_adapter_declares(image_paths):
    adapter = _adapter("qwen2_vl")
    dataset = _dataset(adapter, image_paths)
    examples = _examples(dataset)
    packed = _packed(dataset.collator(), examples)
    assert tuple(packed) == batch_keys(adapter.image_input_names) == (
        "input_ids", "labels", "attention_mask", "position_ids", "pixel_values", "image_grid_thw", "num_loss_tokens")
    # images of every sample in row-major token order, as the processor gives them for those files
    paths = [ref.path for e in examples for ref in e.images]
    expected = adapter.image_inputs(paths)
    for name in adapter.image_input_names:
        assert torch.equal(packed[name], expected[name]), name
    # row 0: the plain position, restarting at every sample; rows 1-3: each sample's own M-RoPE rows
    positions = packed["position_ids"]
    starts = {0: 0, 1: 0}
    for example, row in zip(examples, ROWS):
        n = len(example)
        ids = torch.tensor(example.input_ids)
        own = adapter.position_ids(ids, adapter.image_inputs([ref.path for ref in example.images]))
        assert torch.equal(positions[0, row, starts[row]:starts[row] + n], torch.arange(n))
        assert torch.equal(positions[1:, row, starts[row]:starts[row] + n], own)
        starts[row] += n
    pad = packed["input_ids"].shape[1] - starts[1]
    assert pad > 0 and torch.equal(positions[:, 1, starts[1]:], torch.arange(pad).expand(4, -1))
    # a text-only batch passes no image input at all
    text_only = dataset.collator()([examples[2]])
    assert text_only["pixel_values"] is None and text_only["image_grid_thw"] is None
    assert "pixel_values" not in model_inputs(text_only) and "image_grid_thw" not in model_inputs(text_only)


def test_positions_must_restart_per_sample(image_paths):
    """What keeps packed samples apart is the plain row 0 restarting at every sample: run on
    across the row (one long sequence's positions), or left out ([3, B, L], what transformers'
    own positions would be), and the later samples attend to the earlier ones."""
    adapter = _adapter("qwen2_vl")
    model = adapter.load_model().eval()
    dataset = _dataset(adapter, image_paths)
    examples = _examples(dataset)
    collate = dataset.collator()
    row = collate([replace(e, row=0) for e in examples[:4]])  # a, one, c, e in one row
    with torch.no_grad():
        alone = [model(**model_inputs(collate([e]))).logits[0] for e in examples[:4]]
        good = model(**model_inputs(row)).logits[0]
        running = dict(row, position_ids=row["position_ids"].clone())
        running["position_ids"][0] = torch.arange(row["input_ids"].shape[1])
        leaky = model(**model_inputs(running)).logits[0]
        rows_only = model(**model_inputs(dict(row, position_ids=row["position_ids"][1:]))).logits[0]
    start = 0
    for example, logits in zip(examples[:4], alone):
        n = len(example)
        torch.testing.assert_close(good[start:start + n], logits, rtol=0, atol=1e-5)
        start += n
    last = slice(start - len(examples[3]), start)  # e, after three other samples
    assert (leaky[last] - alone[3]).abs().max() > 1e-3
    assert (rows_only[last] - alone[3]).abs().max() > 1e-3


class _Recorder:
    """Wraps transformers' ``sdpa`` attention function and mask builder (both looked up at call time)."""

    def __init__(self, monkeypatch):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        self.calls, self.masks_built = [], 0
        attention, mask = AttentionInterface._global_mapping["sdpa"], AttentionMaskInterface._global_mapping["sdpa"]

        def recording_attention(module, query, key, value, attention_mask, *args, **kwargs):
            self.calls.append((type(module).__name__, tuple(query.shape), tuple(key.shape), attention_mask))
            return attention(module, query, key, value, attention_mask, *args, **kwargs)

        def counting_mask(*args, **kwargs):
            self.masks_built += 1
            return mask(*args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", recording_attention)
        monkeypatch.setitem(AttentionMaskInterface._global_mapping, "sdpa", counting_mask)


def test_per_sample_attention_builds_no_4d_mask(image_paths, monkeypatch):
    adapter = _adapter("qwen2_5_vl")
    model = adapter.load_model().train()
    dataset = _dataset(adapter, image_paths)
    examples = _examples(dataset)
    packed = _packed(dataset.collator(), examples)
    lm = language_model(model, adapter.text_config(model.config))
    layers = adapter.text_config(model.config).num_hidden_layers
    lengths = sorted(len(e) for e in examples) + [packed["input_ids"].shape[1] * 2 - sum(len(e) for e in examples)]
    recorder = _Recorder(monkeypatch)
    with use_attention(lm, "mmtune_packed_sdpa"):
        _loss_and_grads(model, [packed])
    calls = [c for c in recorder.calls if "Vision" not in c[0]]
    assert recorder.masks_built == 0
    assert calls and all(mask is None and q[2] == k[2] for _, q, k, mask in calls)
    assert sum(q[0] * q[2] * k[2] for _, q, k, _ in calls) == layers * sum(n * n for n in lengths)
