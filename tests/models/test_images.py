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
    adapter = build_adapter(ModelConfig(family="llava", llava={"image_aspect_ratio": aspect}))
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


@pytest.mark.parametrize("family, aspect", [("llava", "pad"), ("llava", "resize"), ("internlm_xcomposer2", None)])
def test_an_image_above_the_limits_is_refused_from_its_header_before_any_decode(family, aspect, tmp_path, monkeypatch):
    from mmtune.core.images import ImageLimits, ImageTooLargeError

    thin = tmp_path / "thin.png"
    PILImage.new("L", (1, 10000)).save(thin, optimize=True)  # ~100 bytes; LLaVA's pad canvas: 10000 x 10000
    section = {"llava": {"image_aspect_ratio": aspect}} if aspect else {}
    adapter = build_adapter(ModelConfig(family=family, **section))
    decoded = []
    real_load = PILImage.Image.load
    monkeypatch.setattr(PILImage.Image, "load", lambda self: decoded.append(self.size) or real_load(self))
    with pytest.raises(ImageTooLargeError, match=r"thin\.png.*1 x 10000 px.*max_aspect_ratio=200"):
        adapter.load_uint8(str(thin))
    with pytest.raises(ImageTooLargeError):
        adapter.preprocess_images([str(thin)])
    assert decoded == []  # refused from the header: no pixel and no canvas was made
    # through the pixel cache (training, generation): named with its dialogue and turn, code image_too_large
    with pytest.raises(Exception, match=r"thin\.png' \(dialogue 'd3', turn 3 \(question\)\) is not decoded") as info:
        ImagePipeline(adapter).load_one(str(thin), dialogue_id="d3", turn=4)
    assert info.value.code == "image_too_large"
    # an already decoded image is held to the same limits (XComposer2's official PIL entry point)
    with pytest.raises(ImageTooLargeError):
        adapter.image_transform.from_pil(PILImage.new("RGB", (1, 10000)), adapter.image_limits)
    if aspect == "resize":  # limits raised for data that has such images: it loads
        wide = build_adapter(ModelConfig(family=family, **section,
                                         image_limits=ImageLimits(max_side=10000, max_aspect_ratio=10000)))
        assert wide.load_uint8(str(thin)).shape == (3, wide.image_transform.size, wide.image_transform.size)


def test_qwen_vl_counts_and_loads_only_images_within_the_limits(tmp_path):
    """Qwen-VL's resize target is bounded by max_pixels, but the decoded source is as large as
    the file says: the limits are checked when the image is counted (encoding) and loaded."""
    from mmtune.data.dialogue import Dialogue, Image, Turn
    from mmtune.core.images import ImageLimits, ImageTooLargeError
    from mmtune.data.images import CorruptImageError

    tall = tmp_path / "tall.png"
    PILImage.new("RGB", (10, 1500)).save(tall)  # ratio 150: the processor itself accepts it
    adapter = build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": "qwen2_vl"},
                                        image_limits=ImageLimits(max_side=1000)))
    dialogue = Dialogue("q1", "t", (Turn("user", ("a",)), Turn("assistant", ("b",)),
                                    Turn("user", (Image(str(tall)), "c")), Turn("assistant", ("d",))))
    with pytest.raises(CorruptImageError, match=r"tall\.png' \(dialogue 'q1', turn 2 \(question\)\) is not decoded.*max_side=1000") as info:
        adapter.encode_dialogue(dialogue)
    assert info.value.code == "image_too_large"
    with pytest.raises(ImageTooLargeError):
        adapter.load_uint8(str(tall))
    fits = build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": "qwen2_vl"}))
    assert fits.load_uint8(str(tall)).ndim == 3
