"""Image pipeline: processed-pixel cache, worker-side loading, corrupt-image handling."""

import os

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.collator import CollatorConfig, MultiImageDataset
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import ImageRef
from mmtune.data.images import CorruptImageError, ImagePipeline
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter


@pytest.fixture(scope="module")
def adapter():
    return build_adapter(ModelConfig(family="llava"))


@pytest.fixture()
def files(tmp_path):
    good = tmp_path / "good.jpg"
    PILImage.effect_noise((120, 80), 50).convert("RGB").save(good)
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 this is not a jpeg")
    return str(good), str(bad)


@pytest.mark.parametrize("key", ["content", "stat"])
def test_cache_hit_returns_the_same_pixels(adapter, files, tmp_path, key):
    good, _ = files
    pipe = ImagePipeline(adapter, cache_dir=str(tmp_path / "cache"), key=key)
    first = pipe.load_one(good)
    assert pipe.stats.decoded == 1 and pipe.stats.cache_hits == 0
    again = ImagePipeline(adapter, cache_dir=str(tmp_path / "cache"), key=key)
    second = again.load_one(good)
    assert again.stats.decoded == 0 and again.stats.cache_hits == 1
    assert torch.equal(first, second)
    torch.testing.assert_close(first, adapter.preprocess_images([good])[0])
    stored = [f for _, _, fs in os.walk(tmp_path / "cache") for f in fs]
    assert len(stored) == 1 and stored[0].endswith(".px")


def test_cache_key_includes_processor_settings(files, tmp_path):
    good, _ = files
    pad = ImagePipeline(build_adapter(ModelConfig(family="llava")), cache_dir=str(tmp_path))
    resize = ImagePipeline(build_adapter(ModelConfig(family="llava", image_aspect_ratio="resize")), cache_dir=str(tmp_path))
    assert pad.settings_hash != resize.settings_hash
    assert not torch.equal(pad.load_one(good), resize.load_one(good))
    assert resize.stats.decoded == 1


def test_content_key_survives_a_copy(adapter, files, tmp_path):
    good, _ = files
    copy = tmp_path / "copy.jpg"
    copy.write_bytes(open(good, "rb").read())
    ImagePipeline(adapter, cache_dir=str(tmp_path / "c")).load_one(good)
    pipe = ImagePipeline(adapter, cache_dir=str(tmp_path / "c"))
    pipe.load_one(str(copy))
    assert pipe.stats.cache_hits == 1


def test_corrupt_image_strict_names_file_dialogue_and_turn(adapter, files):
    good, bad = files
    pipe = ImagePipeline(adapter)
    with pytest.raises(CorruptImageError, match=r"bad\.jpg.*dialogue 'd7', turn 2"):
        pipe.load([ImageRef(good, 0, 16), ImageRef(bad, 2, 16)], dialogue_id="d7")
    assert pipe.stats.corrupt == 1
    with pytest.raises(CorruptImageError, match="missing.jpg"):
        pipe.load_one("/missing.jpg")


def test_dataset_skip_mode_counts_and_drops(adapter, files):
    good, bad = files
    dialogues = [
        Dialogue("ok", "t", (Turn("user", (Image(good), "q")), Turn("assistant", ("a",)))),
        Dialogue("broken", "t", (Turn("user", ("q",)), Turn("assistant", ("a",)), Turn("user", (Image(bad), "q2")), Turn("assistant", ("b",)))),
    ]
    strict = MultiImageDataset(dialogues, adapter, CollatorConfig(max_length=256))
    with pytest.raises(CorruptImageError, match="'broken', turn 2"):
        strict[1]
    lenient = MultiImageDataset(dialogues, adapter, CollatorConfig(max_length=256, image_errors="skip"))
    batch = lenient.collator()([lenient[0], lenient[1]])
    assert lenient.skipped_corrupt == 1 and batch["input_ids"].shape[0] == 1


def test_images_are_decoded_in_dataloader_workers(adapter, files, tmp_path):
    """Pixels come from __getitem__, so with num_workers > 0 the main process decodes nothing."""
    good, _ = files
    dialogues = [Dialogue(f"d{i}", "t", (Turn("user", (Image(good), "q")), Turn("assistant", ("a",)))) for i in range(4)]
    dataset = MultiImageDataset(dialogues, adapter, CollatorConfig(max_length=256, image_cache_dir=str(tmp_path / "px")))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=1, collate_fn=dataset.collator())
    batches = list(loader)
    assert sum(b["pixel_values"].shape[0] for b in batches) == 4
    assert dataset.images.stats.decoded == 0 and dataset.images.stats.cache_hits == 0  # main process untouched
    assert len([f for _, _, fs in os.walk(tmp_path / "px") for f in fs]) == 1  # the worker filled the cache


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_non_rgb_files_match_the_image_processor(adapter, tmp_path, mode):
    path = tmp_path / f"x_{mode}.png"
    PILImage.effect_noise((70, 40), 60).convert(mode).save(path)
    pixels = ImagePipeline(adapter).load_one(str(path))
    reference = adapter.image_processor(images=[PILImage.open(path).convert("RGB")], return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(pixels, reference, atol=1e-5, rtol=0)
