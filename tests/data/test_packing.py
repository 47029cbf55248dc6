"""Packing: position_ids restart per sample, no cross-sample attention; packed == unpacked."""

from dataclasses import replace

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.batching import PlannedBatchSampler
from mmtune.data.collator import CollatorConfig, MultiImageCollator, MultiImageDataset, model_inputs
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import encode_example
from mmtune.data.images import ImagePipeline
from mmtune.data.lengths import compute_lengths


@pytest.fixture(scope="module")
def model(adapter):
    return adapter.load_model().eval()


@pytest.fixture(scope="module")
def dialogues(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (200, 200, 0)]
    paths = []
    for k, colour in enumerate(colours):
        path = root / f"{k}.png"
        PILImage.new("RGB", (60 + 10 * k, 50), colour).save(path)
        paths.append(str(path))
    return [
        Dialogue("a", "t", (Turn("user", (Image(paths[0]), "\nWhat colour?")), Turn("assistant", ("red",)))),
        Dialogue(
            "b", "t",
            (Turn("user", ("Hi there",)), Turn("assistant", ("Hello. Yes No",)),
             Turn("user", ("Image2: ", Image(paths[1]), Image(paths[2]))), Turn("assistant", ("green blue",))),
        ),
        Dialogue("c", "t", (Turn("user", ("Only text here",)), Turn("assistant", ("ok",)))),
        Dialogue("d", "t", (Turn("user", (Image(paths[3]), "Describe the image.")), Turn("assistant", ("yellow square",)))),
    ]


def _examples(adapter, dialogues):
    pipe = ImagePipeline(adapter)
    out = []
    for d in dialogues:
        e = encode_example(adapter, d, max_length=512)
        out.append(replace(e, pixel_values=pipe.load(e.images, dialogue_id=d.id)))
    return out


def _run(model, batch):
    with torch.no_grad():
        return model(**model_inputs(batch))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_and_logits_equal_unpacked(adapter, dialogues, attn):
    model = adapter.load_model(attn_implementation=attn).eval()
    examples = _examples(adapter, dialogues)
    pad = adapter.tokenizer.pad_token_id
    unpacked = MultiImageCollator(pad)(examples)
    rows = [0, 0, 1, 0]  # row 0: a, b, d; row 1: c + padding
    packed = MultiImageCollator(pad, packed=True)([replace(e, row=r) for e, r in zip(examples, rows)])
    assert packed["attention_mask"] is None
    assert packed["input_ids"].shape[0] == 2
    assert packed["num_loss_tokens"] == unpacked["num_loss_tokens"]
    # images keep their order: row-major over the packed rows
    order = [0, 1, 3, 2]
    expected_pixels = torch.cat([examples[i].pixel_values for i in order if examples[i].pixel_values is not None])
    torch.testing.assert_close(packed["pixel_values"], expected_pixels)

    out_u, out_p = _run(model, unpacked), _run(model, packed)
    torch.testing.assert_close(out_p.loss, out_u.loss, atol=1e-5, rtol=0)
    starts = {0: 0, 1: 0}
    for i in order:
        n = len(examples[i])
        r = rows[i]
        torch.testing.assert_close(out_p.logits[r, starts[r] : starts[r] + n], out_u.logits[i, :n], atol=1e-5, rtol=0)
        assert packed["position_ids"][r, starts[r] : starts[r] + n].tolist() == list(range(n))
        starts[r] += n
    # row 1's padding is its own run of positions with ignored labels
    pad_len = packed["input_ids"].shape[1] - starts[1]
    assert pad_len > 0
    assert packed["position_ids"][1, starts[1]:].tolist() == list(range(pad_len))
    assert (packed["labels"][1, starts[1]:] == -100).all()


def test_a_2d_mask_would_leak_across_samples(adapter, model, dialogues):
    """Sanity check that the equality above is sensitive: with a 2-D all-ones mask (what a
    naive packer passes) transformers cannot see the boundaries and samples attend to each other."""
    examples = _examples(adapter, dialogues[:3])
    packed = MultiImageCollator(adapter.tokenizer.pad_token_id, packed=True)([replace(e, row=0) for e in examples])
    leaky = dict(packed, attention_mask=torch.ones_like(packed["input_ids"]))
    n0 = len(examples[0])
    good, bad = _run(model, packed), _run(model, leaky)
    torch.testing.assert_close(good.logits[0, :n0], bad.logits[0, :n0])  # first sample sees nothing earlier anyway
    assert (good.logits[0, n0:] - bad.logits[0, n0:]).abs().max() > 1e-3


def test_transformers_builds_a_block_diagonal_mask(adapter, model):
    """What the SDPA path receives for a packed row: a boolean [B, 1, L, L] block-diagonal mask."""
    from transformers.masking_utils import create_causal_mask

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    embeds = torch.zeros(1, 9, model.config.text_config.hidden_size)
    mask = create_causal_mask(
        config=model.config.text_config, inputs_embeds=embeds, attention_mask=None, cache=None,
        position_ids=position_ids,
    )
    assert mask.dtype == torch.bool and tuple(mask.shape) == (1, 1, 9, 9)
    segment = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    expected = (segment[:, None] == segment[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], expected)


def test_planned_packed_dataloader_matches_unpacked_loss(adapter, model, dialogues):
    cfg = CollatorConfig(max_length=160, batching="packing", batch_size=2, packing_window=8)
    dataset = MultiImageDataset(dialogues, adapter, cfg)
    table = compute_lengths(adapter, dialogues, max_length=cfg.max_length)
    sampler = PlannedBatchSampler(lambda epoch: range(len(dialogues)), table.lengths, cfg)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=dataset.collator())
    batches = list(loader)
    seen = sorted(i for b in sampler._plan() for row in b for i in row)
    assert seen == [0, 1, 2, 3]
    assert all(b["input_ids"].shape[1] <= 160 for b in batches)
    total_tokens = sum(int(b["num_loss_tokens"]) for b in batches)
    packed_sum = sum(float(_run(model, b).loss) * int(b["num_loss_tokens"]) for b in batches)
    unpacked = MultiImageCollator(adapter.tokenizer.pad_token_id)(_examples(adapter, dialogues))
    assert total_tokens == int(unpacked["num_loss_tokens"])
    assert abs(packed_sum / total_tokens - float(_run(model, unpacked).loss)) < 1e-5
