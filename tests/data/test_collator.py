"""The collator: fixed batch keys, padding, pixel order, config validation, dataset + loader."""

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.collator import BATCH_KEYS, CollatorConfig, MultiImageCollator, MultiImageDataset, model_inputs
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import Example, ImageRef, encode_example

@pytest.fixture(scope="module")
def dialogues(tmp_path_factory):
    root = tmp_path_factory.mktemp("coll")
    paths = []
    for k, colour in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
        path = root / f"{k}.png"
        PILImage.new("RGB", (40, 30), colour).save(path)
        paths.append(str(path))
    return [
        Dialogue("a", "t", (Turn("user", (Image(paths[0]), "\nWhat colour?")), Turn("assistant", ("red",)))),
        Dialogue("b", "t", (Turn("user", ("No image",)), Turn("assistant", ("ok",)))),
        Dialogue("c", "t", (Turn("user", (Image(paths[1]), Image(paths[2]), "Compare.")), Turn("assistant", ("green blue",)))),
    ]

def test_padding_batch_has_fixed_keys_and_shapes(adapter, dialogues):
    dataset = MultiImageDataset(dialogues, adapter, CollatorConfig(max_length=256, pad_to_multiple_of=8))
    examples = [dataset[i] for i in range(3)]
    batch = dataset.collator()(examples)
    assert tuple(batch) == BATCH_KEYS
    lengths = [len(e) for e in examples]
    width = -(-max(lengths) // 8) * 8
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (3, width)
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for r, e in enumerate(examples):
        assert batch["input_ids"][r, : lengths[r]].tolist() == e.input_ids
        assert (batch["input_ids"][r, lengths[r]:] == adapter.tokenizer.pad_token_id).all()
        assert (batch["labels"][r, lengths[r]:] == -100).all()
        assert batch["position_ids"][r, : lengths[r]].tolist() == list(range(lengths[r]))
    # pixels in the order of the image-token runs, row-major: a's image, then c's two
    assert batch["pixel_values"].shape == (3, 3, 56, 56)
    expected = adapter.preprocess_images([r.path for e in examples for r in e.images])
    torch.testing.assert_close(batch["pixel_values"], expected)
    n_image_tokens = int((batch["input_ids"] == adapter.image_token_id).sum())
    assert n_image_tokens == batch["pixel_values"].shape[0] * adapter.num_image_tokens
    assert int(batch["num_loss_tokens"]) == sum(e.num_loss_tokens for e in examples)

def test_the_padded_batch_gives_the_model_the_loss_of_each_sample_alone(adapter, dialogues):
    """Padding, label alignment and pixel order change nothing a sample sees: the batch's loss
    (the mean over all its answer tokens) is each sample's loss run alone, weighted by its
    answer tokens, and the cross-entropy recomputed by hand from the logits."""
    model = adapter.load_model().eval()
    dataset = MultiImageDataset(dialogues, adapter, CollatorConfig(max_length=256, pad_to_multiple_of=8))
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, collate_fn=dataset.collator())
    batch = next(iter(loader))
    with torch.no_grad():
        out = model(**model_inputs(batch))
        alone = [(model(**model_inputs(dataset.collator()([dataset[i]]))).loss, dataset[i].num_loss_tokens)
                 for i in range(3)]
    # labels predict the next token: position t's logits score labels[t + 1]
    by_hand = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(),
                                                batch["labels"][:, 1:].flatten(), ignore_index=-100)
    weighted = sum(loss * n for loss, n in alone) / sum(n for _, n in alone)
    assert sum(n for _, n in alone) == int(batch["num_loss_tokens"]) > 0
    torch.testing.assert_close(out.loss, by_hand, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, weighted, rtol=1e-5, atol=1e-5)
    assert len({round(float(loss), 4) for loss, _ in alone}) == 3  # three different samples, not one repeated

def test_text_only_batch_has_no_pixels(adapter, dialogues):
    example = encode_example(adapter, dialogues[1], max_length=256)
    batch = MultiImageCollator(adapter.tokenizer.pad_token_id)([example])
    assert batch["pixel_values"] is None
    assert "pixel_values" not in model_inputs(batch) and model_inputs(batch)["use_cache"] is False

def test_skipped_samples_are_dropped_and_all_skipped_raises(adapter, dialogues):
    dataset = MultiImageDataset(dialogues, adapter, CollatorConfig(max_length=20))  # too short for anything
    assert dataset[0] is None and dataset.truncation_stats.skipped == 1
    with pytest.raises(ValueError, match="every sample of this batch was skipped"):
        dataset.collator()([None])

def test_inconsistent_examples_raise(adapter):
    collate = MultiImageCollator(0)
    with pytest.raises(ValueError, match="'x': 3 input ids but 2 labels"):
        collate([Example("x", [1, 2, 3], [1, 2])])
    with pytest.raises(ValueError, match="no pixel_values and the collator has no image_pipeline"):
        collate([Example("y", [1, 2], [1, 2], [ImageRef("/p.png", 0, 1)])])

def test_config_validation_lists_every_problem():
    cfg = CollatorConfig(max_length=0, truncation="cut", batching="bucket", image_errors="ignore")
    with pytest.raises(ValueError) as err:
        cfg.validate()
    message = str(err.value)
    for key in ("collator.max_length", "collator.truncation", "collator.batching", "collator.image_errors"):
        assert key in message

def test_collator_yaml_group_composes():
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[2] / "configs"
    schema = OmegaConf.structured(CollatorConfig)
    names = sorted(p.stem for p in (root / "collator").glob("*.yaml"))
    assert {"default", "packing_8k"} <= set(names)
    typed = {}
    with initialize_config_dir(config_dir=str(root / "collator"), version_base=None):
        for name in names:
            cfg = OmegaConf.merge(schema, compose(config_name=name))  # unknown keys fail here
            typed[name] = OmegaConf.to_object(cfg)
            typed[name].validate()
    assert typed["packing_8k"].batching == "packing" and typed["packing_8k"].max_length == 8192
    assert typed["packing_8k"].truncation == "drop_trailing_turns"  # inherited from default
