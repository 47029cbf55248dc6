"""The shared square-image path: what each family's pixels are, and a cache key derived from its settings."""

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.images import ImagePipeline
from mmtune.models.config import ModelConfig
from mmtune.models.images import SquareImage, SquareImageAdapter
from mmtune.models.registry import build_adapter

SIZES = [(800, 600), (801, 599), (200, 57), (60, 80), (333, 500), (56, 56), (30, 490)]
MODES = ["RGB", "L", "RGBA", "P"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("noise")
    paths = []
    for k, size in enumerate(SIZES):
        path = root / f"n{k}.png"
        PILImage.effect_noise(size, 70).convert(MODES[k % len(MODES)]).save(path)
        paths.append(str(path))
    return paths


class _Stub(SquareImageAdapter):
    family = "stub"

    def __init__(self, transform):
        self.image_transform = transform

    def normalize_uint8(self, pixels):
        return pixels.to(torch.float32)


def test_every_setting_of_the_transform_is_part_of_the_cache_key(tmp_path):
    base = SquareImage(56, pad=True, fill=(10, 20, 30))
    changed = {"size": 64, "pad": False, "fill": (0, 0, 0), "resample": "bilinear"}
    assert set(changed) == {f.name for f in dataclasses.fields(SquareImage)}  # a new field must be added here
    keys = {ImagePipeline(_Stub(base), cache_dir=str(tmp_path)).settings_hash}
    for name, value in changed.items():
        keys.add(ImagePipeline(_Stub(dataclasses.replace(base, **{name: value})), cache_dir=str(tmp_path)).settings_hash)
    assert len(keys) == 1 + len(changed)
    assert ImagePipeline(_Stub(SquareImage(56, pad=True, fill=(10, 20, 30))), cache_dir=str(tmp_path)).settings_hash in keys


def test_xcomposer2_pixels_are_the_official_square_bicubic_resize(files):
    adapter = build_adapter(ModelConfig(family="internlm_xcomposer2"))
    size = adapter.image_size
    for path in files:
        with PILImage.open(path) as image:
            official = np.asarray(image.convert("RGB").resize((size, size), PILImage.BICUBIC)).transpose(2, 0, 1)
        assert np.array_equal(adapter.load_uint8(path), official), path


@pytest.mark.parametrize("aspect", ["pad", "resize"])
def test_llava_pixels_equal_its_image_processor_in_both_aspect_modes(files, aspect):
    adapter = build_adapter(ModelConfig(family="llava", image_aspect_ratio=aspect))
    for path in files:
        with PILImage.open(path) as image:
            reference = adapter.image_processor(images=[image.convert("RGB")], do_rescale=False,
                                                do_normalize=False)["pixel_values"][0]
        assert np.array_equal(adapter.load_uint8(path), np.asarray(reference, dtype=np.uint8)), path


@pytest.mark.parametrize("family", ["llava", "internlm_xcomposer2"])
def test_preprocess_is_the_normalised_uint8_pixels_and_the_cache_serves_the_same(family, files, tmp_path):
    adapter = build_adapter(ModelConfig(family=family))
    pixels = adapter.preprocess_images(files)
    size = adapter.image_transform.size
    assert pixels.shape == (len(files), 3, size, size) and pixels.dtype == torch.float32
    assert torch.equal(pixels, adapter.normalize_uint8(torch.from_numpy(np.stack([adapter.load_uint8(p) for p in files]))))
    pipeline = ImagePipeline(adapter, cache_dir=str(tmp_path))
    first = [pipeline.load_one(p) for p in files]
    again = [pipeline.load_one(p) for p in files]
    assert pipeline.stats.decoded == len(files) and pipeline.stats.cache_hits == len(files)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, again, pixels))
    assert adapter.preprocess_images([]).shape == (0, 3, size, size)
